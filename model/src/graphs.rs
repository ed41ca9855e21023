//! CUDA graphs of a call's layers between their attention launches.
//!
//! A decode step of a small model is hundreds of short kernels (Gemma 3 270M: about a dozen a
//! layer, each a few microseconds on the GPU), and launching each costs the CPU about as much
//! as the GPU spends running it, so the GPU waits between some of them (on an H200, graphs
//! took 0.07-0.10 ms off a 1.2 ms Gemma step; a Llama-3-8B step, which reads 16 GB of
//! weights, never waits and gains nothing). Everything of a layer but its
//! attention (the norms, the projections, the MLP, the residual adds) takes the same
//! arguments at every step of the same number of rows: the scratch's buffers and the
//! weights. So those parts are captured once into CUDA graphs and replayed, one launch a
//! layer. The attention stays launched as before, since its arguments change with the
//! position (the window's rows, the tail's length) and, at a retrieval layer, with what the
//! host decides (the selection, the bucket cache's copies).
//!
//! A call of `layers` layers is `layers + 1` pieces with the attentions between them: piece 0
//! is the embedding and layer 0 up to its attention, piece `k` the rest of layer `k - 1` and
//! layer `k` up to its attention, the last piece the rest of the last layer.

use std::collections::HashMap;

use kvdb_kernels::{Gpu, Graph};

use crate::error::Result;

/// Rows up to which a call's pieces run from graphs: decode steps, one sequence's or a
/// batch's. Longer calls (prefill chunks) keep their launches: their kernels run long enough
/// that launching them costs the GPU nothing, and they seldom repeat with the same rows.
pub(crate) const GRAPH_MAX_ROWS: usize = 64;

/// A scratch's graphs, by the number of rows of the calls they replay. They hold the
/// scratch's buffer addresses, so they live and die with it.
#[derive(Default)]
pub(crate) struct StepGraphs {
    by_rows: HashMap<usize, Pieces>,
}

impl std::fmt::Debug for StepGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut rows: Vec<&usize> = self.by_rows.keys().collect();
        rows.sort_unstable();
        f.debug_struct("StepGraphs").field("rows", &rows).finish()
    }
}

/// Where the calls of one number of rows stand.
enum Pieces {
    /// Run once with launches, which also compiled their kernels and planned their GEMMs (a
    /// capture cannot): the next call captures.
    Seen,
    /// One graph a piece.
    Captured(Vec<Graph>),
    /// A capture failed: launches from now on.
    Launched,
}

impl StepGraphs {
    /// Runs a call: each of its `pieces` pieces (`piece(state, k)` queues piece `k`), with
    /// `between(state, k)` after each piece but the last. `rows` is the call's number of rows
    /// where graphs may be used (`None`: every kernel launched). Pieces run from graphs when
    /// the call is short ([`GRAPH_MAX_ROWS`]): the first call of a number of rows launches
    /// them, the second captures and launches its graphs, later ones launch the graphs.
    /// Where a capture fails, that piece and every later call of as many rows are launched
    /// as without graphs. Returns the graphs launched.
    pub(crate) fn run<S>(
        &mut self,
        gpu: &Gpu,
        rows: Option<usize>,
        pieces: usize,
        state: &mut S,
        mut piece: impl FnMut(&mut S, usize) -> Result<()>,
        mut between: impl FnMut(&mut S, usize) -> Result<()>,
    ) -> Result<usize> {
        let replayable = rows.filter(|&rows| rows <= GRAPH_MAX_ROWS);
        // Out of the map while the call runs; a call that fails leaves its rows unseen.
        let before = match replayable {
            Some(rows) => self.by_rows.remove(&rows),
            None => Some(Pieces::Launched),
        };
        let mut launched = 0;
        let after = match before {
            Some(Pieces::Captured(graphs)) if graphs.len() == pieces => {
                for (k, graph) in graphs.iter().enumerate() {
                    graph.launch()?;
                    launched += 1;
                    if k + 1 < pieces {
                        between(state, k)?;
                    }
                }
                Pieces::Captured(graphs)
            }
            Some(Pieces::Seen) => {
                let mut captured = Vec::with_capacity(pieces);
                for k in 0..pieces {
                    // After a failed capture the piece is launched: nothing of it ran.
                    let graph = match captured.len() == k {
                        true => gpu.capture(|| piece(state, k)).ok().flatten(),
                        false => None,
                    };
                    match graph {
                        Some(graph) => {
                            graph.launch()?;
                            launched += 1;
                            captured.push(graph);
                        }
                        None => piece(state, k)?,
                    }
                    if k + 1 < pieces {
                        between(state, k)?;
                    }
                }
                match captured.len() == pieces {
                    true => Pieces::Captured(captured),
                    false => Pieces::Launched,
                }
            }
            other => {
                for k in 0..pieces {
                    piece(state, k)?;
                    if k + 1 < pieces {
                        between(state, k)?;
                    }
                }
                match other {
                    None => Pieces::Seen,
                    Some(other) => other,
                }
            }
        };
        if let Some(rows) = replayable {
            self.by_rows.insert(rows, after);
        }
        Ok(launched)
    }
}
