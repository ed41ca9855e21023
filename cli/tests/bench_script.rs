//! scripts/gpu-query-bench.sh, run here with stand-ins for the device's tools (nvidia-smi,
//! PyTorch's python3, the bundle's kvdb and random_model), since a script that breaks on the
//! device costs its scarce time: the placements under `GPU_MEMORY_MIB` run while another
//! process holds the rest of the GPU and the resident baseline before them does not; nothing
//! it starts outlives it; its exit status is kept (75 after a cut ingest, 1 when the GPU
//! cannot be held).

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository's script.
fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-query-bench.sh")
}

/// Writes an executable `name` with `body` (a bash script) into `dir`.
fn tool(dir: &Path, name: &str, body: &str) {
    let path = dir.join(name);
    fs::write(&path, format!("#!/usr/bin/env bash\n{body}")).expect("write a stand-in");
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).expect("make it executable");
}

/// A temporary device: stand-ins on a PATH of their own and a bundle, the holder's and the
/// decode-benches' traces in `trace`.
struct FakeDevice {
    dir: tempfile::TempDir,
}

impl FakeDevice {
    /// The stand-ins: a 143,771 MiB GPU; python3 records its PID and what it was asked to
    /// hold (or, with `holder_fails`, exits at once); kvdb's ingest sleeps `ingest_seconds`
    /// (0: it writes the store at once) and its decode-bench records its `--gpu-kv` and
    /// whether the holder is alive.
    fn new(holder_fails: bool, ingest_seconds: u32) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (bin, bundle) = (dir.path().join("path"), dir.path().join("bundle/bin"));
        fs::create_dir_all(&bin).expect("path");
        fs::create_dir_all(&bundle).expect("bundle");
        let trace = dir.path().join("trace");
        let trace = trace.display();
        tool(
            &bin,
            "nvidia-smi",
            "case \"$*\" in\n\
             *memory.total*) echo 143771 ;;\n\
             *memory.used,memory.free*) echo '62739 MiB, 80418 MiB' ;;\n\
             *) echo 'Stand-in GPU' ;;\n\
             esac\n",
        );
        let holder = if holder_fails {
            "exit 3\n".to_string()
        } else {
            format!(
                "echo $$ > {trace}.holder\n\
                 printf '%s\\n' \"$2\" | grep -o 'empty([0-9]* << 20' >> {trace}\n\
                 touch \"$(printf '%s' \"$2\" | grep -o \"open('[^']*'\" | sed \"s/open('//;s/'//\")\"\n\
                 exec sleep 300\n"
            )
        };
        tool(&bin, "python3", &holder);
        tool(
            &bundle,
            "random_model",
            "while [ $# -gt 0 ]; do [ \"$1\" = --out ] && touch \"$2\"; shift; done\n",
        );
        tool(
            &bundle,
            "kvdb",
            &format!(
                "case \"$1\" in\n\
                 ingest) [ {ingest_seconds} -eq 0 ] || exec sleep {ingest_seconds}\n\
                   while [ $# -gt 0 ]; do [ \"$1\" = --store ] && mkdir -p \"$2\"; shift; done ;;\n\
                 decode-bench)\n\
                   placement=resident held=no\n\
                   while [ $# -gt 0 ]; do [ \"$1\" = --gpu-kv ] && placement=$2; shift; done\n\
                   [ -e {trace}.holder ] && kill -0 \"$(cat {trace}.holder)\" 2>/dev/null && held=yes\n\
                   echo \"decode-bench $placement held=$held\" >> {trace}\n\
                   echo 'kvdb: loaded stand-in' >&2 ;;\n\
                 esac\n"
            ),
        );
        Self { dir }
    }

    /// Runs the script for the Llama shape (one copy, an ivf index) with `env` besides.
    fn run(&self, env: &[(&str, &str)]) -> Output {
        let path = format!(
            "{}:{}",
            self.dir.path().join("path").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut command = Command::new("bash");
        command
            .arg(script())
            .arg(self.dir.path().join("bundle"))
            .arg(self.dir.path().join("work"))
            .env("PATH", path)
            .env("OUT", self.dir.path().join("out"))
            .env("COPIES_GEMMA", "0")
            .env("COPIES_LLAMA", "1")
            .env("IVF_LLAMA", "ivf256,np8,norope,all")
            .env("TEXT", script());
        for (key, value) in env {
            command.env(key, value);
        }
        command.output().expect("run the script")
    }

    /// Runs the script ([`Self::run`]) and checks that it exits with `code`; its stdout.
    fn run_to(&self, env: &[(&str, &str)], code: i32) -> String {
        let output = self.run(env);
        assert_eq!(output.status.code(), Some(code), "{}", says(&output));
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn trace(&self) -> String {
        fs::read_to_string(self.dir.path().join("trace")).unwrap_or_default()
    }

    /// Whether the holder the stand-in python3 started is still running (a zombie waiting to
    /// be reaped is not).
    fn holder_alive(&self) -> bool {
        let pid = fs::read_to_string(self.dir.path().join("trace.holder")).unwrap_or_default();
        let stat = fs::read_to_string(format!("/proc/{}/stat", pid.trim())).unwrap_or_default();
        // The state follows the command's closing parenthesis.
        let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next());
        !pid.trim().is_empty() && matches!(state, Some(Some(s)) if s != 'Z')
    }
}

fn says(output: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status.code(),
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

#[test]
fn placements_run_on_the_gpu_memory_asked_and_the_baseline_on_all_of_it() {
    let device = FakeDevice::new(false, 0);
    // Two models, so that the second's baseline shows the first's holder gone.
    let stdout = device.run_to(
        &[
            ("COPIES_GEMMA", "1"),
            ("GEMMA_DEVICES", "cuda"),
            ("GPU_KV", "auto split:50G"),
            ("GPU_MEMORY_MIB", "81559"),
            ("MEM_SAMPLE", "1"),
        ],
        0,
    );
    let per_model = [
        "decode-bench resident held=no",
        // 143,771 MiB less the 81,559 asked.
        "empty(62212 << 20",
        "decode-bench auto held=yes",
        "decode-bench split:50G held=yes",
    ];
    assert_eq!(
        device.trace().lines().collect::<Vec<_>>(),
        [per_model, per_model].concat(),
        "{stdout}"
    );
    assert!(!device.holder_alive(), "the holder outlived the script");
    let log = fs::read_to_string(device.dir.path().join("out/query.log")).expect("query.log");
    assert!(log.contains("the GPU limited to 81559 MiB"), "{log}");
    assert!(device.dir.path().join("out/mem.log").exists());
}

#[test]
fn without_a_limit_nothing_holds_the_gpu() {
    let device = FakeDevice::new(false, 0);
    device.run_to(&[("GPU_KV", "auto")], 0);
    assert_eq!(
        device.trace().lines().collect::<Vec<_>>(),
        ["decode-bench resident held=no", "decode-bench auto held=no"]
    );
}

#[test]
fn a_cut_ingest_exits_75_and_leaves_nothing_running() {
    let device = FakeDevice::new(false, 30);
    let stdout = device.run_to(&[("INGEST_TIMEOUT", "1"), ("MEM_SAMPLE", "1")], 75);
    assert!(stdout.contains("ingest cut after 1 s"), "{stdout}");
    assert!(device.trace().is_empty(), "{}", device.trace());
    // The memory sampler ends with the script: its log stops growing.
    let log = device.dir.path().join("out/mem.log");
    let before = fs::read_to_string(&log).unwrap_or_default().lines().count();
    std::thread::sleep(std::time::Duration::from_millis(2500));
    let after = fs::read_to_string(&log).unwrap_or_default().lines().count();
    assert_eq!(before, after, "the sampler outlived the script");
}

#[test]
fn a_gpu_that_cannot_be_held_stops_the_script_before_the_placements() {
    let device = FakeDevice::new(true, 0);
    let stdout = device.run_to(&[("GPU_KV", "auto"), ("GPU_MEMORY_MIB", "81559")], 1);
    assert!(stdout.contains("could not hold 62212 MiB"), "{stdout}");
    assert_eq!(
        device.trace().lines().collect::<Vec<_>>(),
        ["decode-bench resident held=no"]
    );
}
