//! Questions waiting for a worker that are answered together.
//!
//! On a GPU a batch of questions on one corpus decodes in one step per token
//! ([`kvdb::Corpus::ask_together`]: the weights and the corpus are read once for all of them),
//! several times the throughput of answering them one by one. So a question whose options
//! allow it ([`crate::Config::max_batch`] above 1) waits in its corpus's line of questions
//! with the same options; the first of a line to get a worker takes up to `max_batch - 1`
//! others still waiting there (they *ride*: no worker of their own) and answers them all on
//! its worker, streaming each one's text to its own client. A rider whose client leaves
//! stops there; the batch goes on.
//!
//! The batch forms when a worker frees: a question that arrives while a batch runs waits
//! for the next one (no joining a batch mid-answer).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kvdb::Answer;
use tokio::sync::{mpsc, oneshot};

use crate::error::ApiResult;
use crate::state::lock;

/// A question waiting in its line, as its batch's leader needs it.
#[derive(Debug)]
pub(crate) struct Waiting {
    id: u64,
    /// The question.
    pub(crate) question: String,
    /// Where its text goes, piece by piece (closed when its client is gone).
    pub(crate) pieces: mpsc::UnboundedSender<String>,
    /// Where its answer goes once the batch ends.
    pub(crate) done: oneshot::Sender<ApiResult<Answer>>,
    /// Told when a leader takes it.
    taken: Option<oneshot::Sender<()>>,
}

/// The lines of questions waiting for a worker, one per corpus and options.
#[derive(Debug, Default)]
pub(crate) struct Batches {
    lines: Mutex<HashMap<String, Vec<Waiting>>>,
    next: AtomicU64,
}

/// A question's place in a line, from [`Batches::wait`]; leaves the line when dropped.
#[derive(Debug)]
pub(crate) struct Place {
    batches: Arc<Batches>,
    line: String,
    id: u64,
}

impl Drop for Place {
    fn drop(&mut self) {
        let mut lines = lock(&self.batches.lines);
        if let Some(line) = lines.get_mut(&self.line) {
            line.retain(|w| w.id != self.id);
            if line.is_empty() {
                lines.remove(&self.line);
            }
        }
    }
}

/// What a question taken by a leader receives.
#[derive(Debug)]
pub(crate) struct Ride {
    /// Its text, piece by piece, until the batch ends.
    pub(crate) pieces: mpsc::UnboundedReceiver<String>,
    /// Its answer.
    pub(crate) done: oneshot::Receiver<ApiResult<Answer>>,
    /// Resolves when a leader takes it.
    pub(crate) taken: oneshot::Receiver<()>,
}

impl Batches {
    /// Puts `question` at the end of `line` (its corpus and options).
    pub(crate) fn wait(self: &Arc<Self>, line: String, question: String) -> (Place, Ride) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let (pieces_tx, pieces) = mpsc::unbounded_channel();
        let (done_tx, done) = oneshot::channel();
        let (taken_tx, taken) = oneshot::channel();
        lock(&self.lines)
            .entry(line.clone())
            .or_default()
            .push(Waiting {
                id,
                question,
                pieces: pieces_tx,
                done: done_tx,
                taken: Some(taken_tx),
            });
        let place = Place {
            batches: self.clone(),
            line,
            id,
        };
        (
            place,
            Ride {
                pieces,
                done,
                taken,
            },
        )
    }

    /// `place`'s question got a worker: it leads a batch of itself and up to `riders`
    /// questions of its line, which are taken out of it (and told). `None` when a leader
    /// took it first (it rides then).
    pub(crate) fn lead(place: &Place, riders: usize) -> Option<Vec<Waiting>> {
        let mut lines = lock(&place.batches.lines);
        let line = lines.get_mut(&place.line)?;
        let at = line.iter().position(|w| w.id == place.id)?;
        line.remove(at);
        let mut taken: Vec<Waiting> = line.drain(..riders.min(line.len())).collect();
        if line.is_empty() {
            lines.remove(&place.line);
        }
        drop(lines);
        for waiting in &mut taken {
            if let Some(told) = waiting.taken.take() {
                // A rider whose request ended meanwhile finds out when its text is sent.
                let _ = told.send(());
            }
        }
        Some(taken)
    }
}
