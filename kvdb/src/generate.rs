//! The decoding loop: prompt prefill in chunks, then sampled decode steps, streamed token by
//! token. Plain generation runs it over full attention from position 0; a corpus query runs
//! it after the corpus, over retrieval attention.

use std::cell::Cell;

use candle_core::Tensor;
use candle_transformers::generation::{LogitsProcessor, Sampling};
#[cfg(feature = "gpu")]
use kvdb_model::{Batch, Pick, Picked};
use kvdb_model::{Forward, Logits, StreamDecoder, Tokenizer};
use serde::Serialize;

use crate::error::{Error, Result};

/// Sampling and stopping parameters.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Most new tokens.
    pub max_tokens: usize,
    /// 0 for greedy decoding.
    pub temperature: f64,
    /// Nucleus sampling threshold (1 = off).
    pub top_p: f64,
    /// Sampling seed.
    pub seed: u64,
    /// Generation stops before any of these strings; they are not printed.
    pub stop: Vec<String>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        Self {
            max_tokens: 128,
            temperature: 0.0,
            top_p: 1.0,
            seed: 299_792_458,
            stop: Vec::new(),
        }
    }
}

/// Highest sampling temperature accepted: past 2 the distribution is close to uniform and
/// the text noise.
pub const MAX_TEMPERATURE: f64 = 2.0;
/// Most keys a query may retrieve per retrieval layer and KV head at each step.
pub const MAX_K: usize = 1 << 16;

/// An option value outside what generation accepts. The CLI (at argument parsing) and the
/// server (as a 422) check with the same functions, so both refuse the same values.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("`{name}` must be {expected}, not {given}")]
pub struct OptionError {
    /// The option.
    pub name: &'static str,
    /// What it must be.
    pub expected: String,
    /// What was given.
    pub given: String,
}

/// `temperature` if it is in `[0, MAX_TEMPERATURE]` (NaN and infinities are not).
pub fn checked_temperature(temperature: f64) -> std::result::Result<f64, OptionError> {
    if (0.0..=MAX_TEMPERATURE).contains(&temperature) {
        Ok(temperature)
    } else {
        Err(OptionError {
            name: "temperature",
            expected: format!("in [0, {MAX_TEMPERATURE}]"),
            given: temperature.to_string(),
        })
    }
}

/// `top_p` if it is in `(0, 1]`.
pub fn checked_top_p(top_p: f64) -> std::result::Result<f64, OptionError> {
    if top_p > 0.0 && top_p <= 1.0 {
        Ok(top_p)
    } else {
        Err(OptionError {
            name: "top_p",
            expected: "in (0, 1]".into(),
            given: top_p.to_string(),
        })
    }
}

/// `k` if it is in `1..=MAX_K`.
pub fn checked_k(k: usize) -> std::result::Result<usize, OptionError> {
    checked_count("k", k, 1..=MAX_K)
}

/// `follow` ([`Retrieval::follow`](crate::Retrieval::follow), 0: off) if it is in
/// `0..=MAX_K`, `k`'s bound: a step follows only tokens it retrieved, so no useful value is
/// larger.
pub fn checked_follow(follow: usize) -> std::result::Result<usize, OptionError> {
    checked_count("follow", follow, 0..=MAX_K)
}

/// The count option `name` if it is in `range`.
fn checked_count(
    name: &'static str,
    value: usize,
    range: std::ops::RangeInclusive<usize>,
) -> std::result::Result<usize, OptionError> {
    if range.contains(&value) {
        Ok(value)
    } else {
        Err(OptionError {
            name,
            expected: format!("in {}..={}", range.start(), range.end()),
            given: value.to_string(),
        })
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model produced an end-of-generation token.
    EndOfText,
    /// A stop string appeared.
    StopString,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The model's context is full.
    ContextFull,
    /// Its reader went away (its text callback returned [`Error::Abandoned`]) while the
    /// answers it was decoded with went on ([`crate::Corpus::ask_together`]).
    Abandoned,
}

/// What a generation produced.
#[derive(Debug, Clone)]
pub struct Generation {
    /// Prompt tokens (BOS included).
    pub prompt_tokens: usize,
    /// Generated token ids (the end-of-text token excluded).
    pub tokens: Vec<u32>,
    /// The generated text (stop string excluded).
    pub text: String,
    /// Why it ended.
    pub stop: StopReason,
    /// Seconds spent on the prompt.
    pub prefill_seconds: f64,
    /// Seconds spent generating.
    pub decode_seconds: f64,
}

/// Runs `prompt` through `sequence` (a model with an empty state, on any device) and samples
/// up to `options.max_tokens` tokens, calling `on_text` with each newly decoded piece of text.
pub fn generate(
    sequence: &mut dyn Forward,
    tokenizer: &Tokenizer,
    prompt: &str,
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<Generation> {
    let prompt_ids = tokenizer.encode(prompt, tokenizer.prompt_options())?;
    if prompt_ids.is_empty() {
        return Err(Error::EmptyInput {
            what: "prompt",
            hint: " and the model adds no BOS token: give it some text",
        });
    }
    continue_generation(sequence, tokenizer, &prompt_ids, options, on_text)
}

/// Prefills `prompt_ids` after what `sequence` already holds, then samples up to
/// `options.max_tokens` tokens, calling `on_text` with each newly decoded piece of text.
pub(crate) fn continue_generation(
    sequence: &mut dyn Forward,
    tokenizer: &Tokenizer,
    prompt_ids: &[u32],
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<Generation> {
    let started = std::time::Instant::now();
    let (logits, mut decoding) = prefill(sequence, tokenizer, prompt_ids, options)?;
    let prefill_seconds = started.elapsed().as_secs_f64();
    let started = std::time::Instant::now();
    let mut drawn = decoding.next(Draw::Logits(&logits), on_text)?;
    while let Some(next) = drawn {
        drawn = match decoding.greedy {
            // The device picks the token: no vocabulary of logits crosses to the host.
            true => decoding.next(Draw::Picked(sequence.forward_greedy(next)?), on_text)?,
            false => {
                let logits = sequence
                    .forward(&[next], &Logits::Last)?
                    .ok_or_else(|| Error::Internal("the model returned no logits".into()))?
                    .squeeze(0)?;
                decoding.next(Draw::Logits(&logits), on_text)?
            }
        };
    }
    decoding.finish(prefill_seconds, started.elapsed().as_secs_f64(), on_text)
}

/// Runs `prompt_ids` through `sequence` after what it holds (checked against the model's
/// context): the last position's logits `[vocab]`, and the decoding that samples from them.
pub(crate) fn prefill<'t>(
    sequence: &mut dyn Forward,
    tokenizer: &'t Tokenizer,
    prompt_ids: &[u32],
    options: &'t GenerateOptions,
) -> Result<(Tensor, Decoding<'t>)> {
    let context = sequence.config().context_length;
    let start = sequence.position();
    if prompt_ids.is_empty() {
        return Err(Error::EmptyInput {
            what: "prompt",
            hint: ": there is nothing to generate from",
        });
    }
    if start + prompt_ids.len() >= context {
        return Err(kvdb_model::ModelError::ContextOverflow {
            tokens: start + prompt_ids.len() + 1,
            context,
        }
        .into());
    }
    let mut logits = None;
    let per_call = sequence.prefill_chunk().max(1);
    for (i, chunk) in prompt_ids.chunks(per_call).enumerate() {
        let last = (i + 1) * per_call >= prompt_ids.len();
        let want = if last { Logits::Last } else { Logits::None };
        logits = sequence.forward(chunk, &want)?;
    }
    let logits = logits
        .ok_or_else(|| Error::Internal("the model returned no logits".into()))?
        .squeeze(0)?;
    let decoding = Decoding::new(
        tokenizer,
        options,
        prompt_ids.len(),
        start + prompt_ids.len(),
        context,
    );
    Ok((logits, decoding))
}

/// Where a generation's next token comes from.
#[derive(Clone, Copy)]
pub(crate) enum Draw<'a> {
    /// Sampled from the last position's logits (`[vocab]`).
    Logits(&'a Tensor),
    /// Picked already: the model's greedy choice, made on its device
    /// ([`Forward::forward_greedy`]), for a generation whose sampling is greedy.
    Picked(u32),
}

/// One generation's sampling, token by token, from the logits of its last position: the
/// sampler, the streamed text and stop strings, and when to stop. One sequence's loop and a
/// batch's each drive one per answer.
pub(crate) struct Decoding<'t> {
    tokenizer: &'t Tokenizer,
    sampler: LogitsProcessor,
    /// Whether sampling is greedy (temperature 0): the model may then pick the tokens itself.
    pub(crate) greedy: bool,
    decoder: StreamDecoder<'t>,
    stops: StopMatcher<'t>,
    max_tokens: usize,
    prompt_tokens: usize,
    /// The position of the next token the model runs.
    position: usize,
    context: usize,
    tokens: Vec<u32>,
    text: String,
    stop: Option<StopReason>,
}

impl<'t> Decoding<'t> {
    fn new(
        tokenizer: &'t Tokenizer,
        options: &'t GenerateOptions,
        prompt_tokens: usize,
        position: usize,
        context: usize,
    ) -> Self {
        let sampling = if options.temperature <= 0.0 {
            Sampling::ArgMax
        } else if options.top_p < 1.0 {
            Sampling::TopP {
                p: options.top_p,
                temperature: options.temperature,
            }
        } else {
            Sampling::All {
                temperature: options.temperature,
            }
        };
        Self {
            tokenizer,
            greedy: matches!(sampling, Sampling::ArgMax),
            sampler: LogitsProcessor::from_sampling(options.seed, sampling),
            decoder: tokenizer.stream_decoder(),
            stops: StopMatcher::new(&options.stop),
            max_tokens: options.max_tokens,
            prompt_tokens,
            position,
            context,
            tokens: Vec::new(),
            text: String::new(),
            stop: None,
        }
    }

    /// Draws a token (sampled from the last position's logits, or picked by the model) and
    /// streams its text to `on_text`; returns the token for the model to run next, or `None`
    /// once the generation has ended (end of text, a stop string, `max_tokens`, the context
    /// full).
    pub(crate) fn next(
        &mut self,
        from: Draw<'_>,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Option<u32>> {
        match self.draw(from)? {
            Some(next) => self.accept(next, on_text),
            None => Ok(None),
        }
    }

    /// [`Decoding::next`]'s first half, which needs nothing but this generation (a batch
    /// draws its answers' tokens in parallel): the token drawn, or `None` when the
    /// generation had already ended.
    fn draw(&mut self, from: Draw<'_>) -> Result<Option<u32>> {
        if self.stop.is_some() {
            return Ok(None);
        }
        if self.tokens.len() >= self.max_tokens {
            self.stop = Some(StopReason::MaxTokens);
            return Ok(None);
        }
        Ok(Some(match from {
            Draw::Logits(logits) => self.sampler.sample(logits)?,
            Draw::Picked(token) => token,
        }))
    }

    /// [`Decoding::next`]'s second half: takes the drawn token `next`, streams its text.
    fn accept(
        &mut self,
        next: u32,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Option<u32>> {
        if self.tokenizer.is_end_of_generation(next) {
            self.stop = Some(StopReason::EndOfText);
            return Ok(None);
        }
        self.tokens.push(next);
        let piece = self.decoder.push(next)?;
        let (emit, stopped) = self.stops.push(&piece);
        self.text.push_str(&emit);
        on_text(&emit)?;
        self.stop = if stopped {
            Some(StopReason::StopString)
        } else if self.tokens.len() >= self.max_tokens {
            Some(StopReason::MaxTokens)
        } else if self.position >= self.context {
            Some(StopReason::ContextFull)
        } else {
            None
        };
        if self.stop.is_some() {
            return Ok(None);
        }
        self.position += 1;
        Ok(Some(next))
    }

    /// The generation, once [`Decoding::next`] has returned `None`: the text held back for
    /// stop strings goes to `on_text`.
    pub(crate) fn finish(
        self,
        prefill_seconds: f64,
        decode_seconds: f64,
        on_text: &mut dyn FnMut(&str) -> Result<()>,
    ) -> Result<Generation> {
        let Self {
            decoder,
            mut stops,
            tokens,
            mut text,
            stop,
            prompt_tokens,
            ..
        } = self;
        let stop = stop.ok_or_else(|| Error::Internal("a generation finished early".into()))?;
        if stop != StopReason::StopString {
            let rest = stops.finish(&decoder.finish());
            text.push_str(&rest);
            on_text(&rest)?;
        }
        Ok(Generation {
            prompt_tokens,
            tokens,
            text,
            stop,
            prefill_seconds,
            decode_seconds,
        })
    }
}

/// Prefills each prompt in its own sequence of `batch`, one after another, then decodes the
/// answers together: each step runs one token of every unfinished answer in one
/// [`Batch::step`]. `on_text(i, piece)` streams answer `i`'s text; where it returns
/// [`Error::Abandoned`], answer `i` leaves the batch (stopped as [`StopReason::Abandoned`])
/// and the others go on. Returns the generations in the order of `prompts` (prefill seconds
/// its own prompt's; decode seconds from its first token to its last) and how the steps
/// went.
#[cfg(feature = "gpu")]
pub(crate) fn generate_batch(
    batch: &mut dyn Batch,
    tokenizer: &Tokenizer,
    prompts: &[Vec<u32>],
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(usize, &str) -> Result<()>,
) -> Result<(Vec<Generation>, BatchSteps)> {
    use rayon::prelude::*;
    let origin = std::time::Instant::now();
    let since = || origin.elapsed().as_secs_f64();
    let mut decodings = Vec::with_capacity(prompts.len());
    // Per answer: its prefill's seconds, when its first token came and when it ended.
    let (mut prefills, mut firsts, mut ended) = (Vec::new(), Vec::new(), Vec::new());
    let mut step: Vec<(usize, u32)> = Vec::new();
    // Answers whose reader went away: their text goes nowhere and they take no more steps.
    let gone: Vec<Cell<bool>> = prompts.iter().map(|_| Cell::default()).collect();
    let mut on_text =
        |b: usize, piece: &str| -> Result<()> { unless_gone(&gone[b], || on_text(b, piece)) };
    // Whether answer `b` goes on with `next` (else it stops, abandoned if its reader left).
    let goes_on = |b: usize, decoding: &mut Decoding, next: Option<u32>| match gone[b].get() {
        true => {
            decoding.stop = Some(StopReason::Abandoned);
            None
        }
        false => next,
    };
    for (b, prompt) in prompts.iter().enumerate() {
        let begun = since();
        let (logits, mut decoding) = prefill(batch.sequence(b)?, tokenizer, prompt, options)?;
        prefills.push(since() - begun);
        let next = decoding.next(Draw::Logits(&logits), &mut |piece| on_text(b, piece))?;
        if let Some(next) = goes_on(b, &mut decoding, next) {
            step.push((b, next));
        }
        firsts.push(since());
        ended.push(since());
        decodings.push(decoding);
    }
    let mut steps = BatchSteps {
        prefill_seconds: since(),
        ..BatchSteps::default()
    };
    // Greedy answers' tokens are picked on the device.
    let pick = match decodings.iter().all(|d| d.greedy) {
        true => Pick::Greedy,
        false => Pick::Logits,
    };
    while !step.is_empty() {
        let ran = batch.step(&step, pick)?;
        steps.queue_seconds += ran.queued_seconds;
        steps.steps += 1;
        steps.tokens += step.len();
        let sampling = since();
        // Each answer's token drawn from its row of logits on a thread of its own (the rows
        // are vocabulary-long: 16 answers of Llama 3 took 3.6 ms one after another), or taken
        // from the GPU's picks, then streamed in order.
        let mut slots: Vec<Option<&mut Decoding>> = decodings.iter_mut().map(Some).collect();
        let mut rows = Vec::with_capacity(step.len());
        for (row, &(b, _)) in step.iter().enumerate() {
            let decoding = slots[b]
                .take()
                .ok_or_else(|| Error::Internal(format!("answer {b} twice in one step")))?;
            rows.push((b, row, decoding));
        }
        let drawn = match &ran.picked {
            Picked::Logits(logits) => rows
                .par_iter_mut()
                .map(|(_, row, decoding)| decoding.draw(Draw::Logits(&logits.get(*row)?)))
                .collect::<Result<Vec<_>>>()?,
            Picked::Greedy(tokens) => rows
                .iter_mut()
                .map(|(_, row, decoding)| match tokens.get(*row) {
                    Some(&token) => decoding.draw(Draw::Picked(token)),
                    None => Err(Error::Internal(format!("no token for row {row}"))),
                })
                .collect::<Result<Vec<_>>>()?,
        };
        let mut following = Vec::with_capacity(step.len());
        for ((b, _, decoding), next) in rows.into_iter().zip(drawn) {
            let next = match next {
                Some(next) => decoding.accept(next, &mut |piece| on_text(b, piece))?,
                None => None,
            };
            match goes_on(b, decoding, next) {
                Some(next) => following.push((b, next)),
                None => ended[b] = since(),
            }
        }
        steps.sample_seconds += since() - sampling;
        step = following;
    }
    steps.decode_seconds = since() - steps.prefill_seconds;
    let generations = decodings
        .into_iter()
        .enumerate()
        .map(|(b, decoding)| {
            decoding.finish(prefills[b], ended[b] - firsts[b], &mut |piece| {
                on_text(b, piece)
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((generations, steps))
}

/// Streams a piece of an answer of several (`stream`, unless its reader already left): a
/// reader that leaves ([`Error::Abandoned`]) sets `gone` and stops nothing else.
pub(crate) fn unless_gone(gone: &Cell<bool>, stream: impl FnOnce() -> Result<()>) -> Result<()> {
    if gone.get() {
        return Ok(());
    }
    match stream() {
        Err(Error::Abandoned) => {
            gone.set(true);
            Ok(())
        }
        other => other,
    }
}

/// How a batch's decode went ([`generate_batch`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct BatchSteps {
    /// Seconds prefilling the prompts, one after another (each answer's first token
    /// included): until the first batched step.
    pub prefill_seconds: f64,
    /// Seconds of the batched steps.
    pub decode_seconds: f64,
    /// Batched steps run.
    pub steps: usize,
    /// Tokens they ran (a token of each unfinished answer per step).
    pub tokens: usize,
    /// Seconds of the batched steps spent on the host sampling the next tokens from the
    /// logits (greedy answers: taking the tokens the GPU picked) and streaming their text
    /// (on the CPU: 0, not told apart).
    pub sample_seconds: f64,
    /// Seconds of the batched steps the host spent queuing their layers' work
    /// ([`kvdb_model::BatchStep::queued_seconds`]): near the steps' time (less sampling),
    /// the steps wait on the host's launches, not on the GPU.
    pub queue_seconds: f64,
}

/// Holds back streamed text that could still turn into a stop string.
#[derive(Debug)]
struct StopMatcher<'a> {
    stops: &'a [String],
    pending: String,
}

impl<'a> StopMatcher<'a> {
    fn new(stops: &'a [String]) -> Self {
        Self {
            stops,
            pending: String::new(),
        }
    }

    /// Adds text; returns what can be shown now and whether a stop string was found (the
    /// text before it is returned, the stop string and anything after it are dropped).
    fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        let first_stop = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first_stop {
            let emit = self.pending[..at].to_string();
            self.pending.clear();
            return (emit, true);
        }
        // Keep the longest suffix that is a prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len())
                    .filter(|&n| s.is_char_boundary(n) && self.pending.ends_with(&s[..n]))
                    .max()
            })
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let emit = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (emit, false)
    }

    fn finish(&mut self, tail: &str) -> String {
        self.pending.push_str(tail);
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_held_back_and_cut() {
        let stops = vec!["\n\n".to_string(), "END".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("Hello"), ("Hello".to_string(), false));
        assert_eq!(m.push(" wor\n"), (" wor".to_string(), false));
        assert_eq!(m.push("ld"), ("\nld".to_string(), false));
        assert_eq!(m.push(" EN"), (" ".to_string(), false));
        assert_eq!(m.push("Dtail"), (String::new(), true));
    }

    #[test]
    fn text_without_stops_passes_through() {
        let mut m = StopMatcher::new(&[]);
        assert_eq!(m.push("abc"), ("abc".to_string(), false));
        assert_eq!(m.finish("d"), "d");
    }
}
