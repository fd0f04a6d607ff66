//! The simulator's CUDA graphs: between `begin_capture` and `end_capture` the operations the
//! calling thread queues on its current stream are recorded, not run (as stream capture does
//! on a GPU); a replay queues the recorded operations again, with the pointers and scalars of
//! the capture. The calls CUDA's thread-local capture mode refuses on the capturing thread
//! (synchronizing, host copies, allocating and freeing device memory), and event records,
//! event waits and peer copies (which CUDA could capture; the glue's graphs use none), are
//! errors here, and the capture's end reports the first of them. Only
//! the capturing thread's work is recorded and refused: another thread's work on the device
//! runs as usual (on a GPU it would join the graph; the product drives each device from one
//! worker thread, and tests that share a simulated device run in parallel). A
//! replay first checks that every driver allocation the graph uses is still live with its
//! size: a graph that outlives a buffer freed to the driver is an error, not a silent write
//! into freed memory (a block returned to the allocator's cache is not seen here: the graphs'
//! pool, `graph.rs`, keeps their blocks from being handed out).
//!
//! Owns: [`Capture`], [`SimGraph`]. May call: the parent `sim`'s state. Must not: run work.

use super::{Op, Sim, State};
use crate::device::cuda::driver::{current_stream, Graph, Stream};
use anyhow::{bail, Result};

/// A capture in progress on `stream` of one simulated device.
pub(super) struct Capture {
    pub stream: Stream,
    pub thread: std::thread::ThreadId,
    /// The recorded operations and the allocations (start addresses) each uses.
    pub ops: Vec<(Op, Vec<u64>)>,
    /// The first call refused while capturing.
    pub refused: Option<String>,
}

/// A captured graph of cuda-sim:`ordinal`.
pub(crate) struct SimGraph {
    ordinal: usize,
    ops: Vec<(Op, Vec<u64>)>,
    /// (start, bytes) of every allocation the operations use, as at the capture.
    allocs: Vec<(u64, usize)>,
}

impl SimGraph {
    /// Operations recorded.
    pub fn len(&self) -> usize {
        self.ops.len()
    }
}

impl State {
    /// An error (remembered for the capture's end) when a capture is in progress: `what` is a
    /// call the capturing thread may not make.
    pub(super) fn refuse_in_capture(&mut self, dev: &str, what: &str) -> Result<()> {
        if let Some(c) = self.capture.as_mut().filter(|c| c.thread == std::thread::current().id()) {
            let msg = format!(
                "{dev}: {what} during CUDA-graph capture of the {} stream (not allowed while capturing: the work \
                 a graph records must use buffers that exist before it and must not wait for the host)",
                c.stream.name()
            );
            c.refused.get_or_insert_with(|| msg.clone());
            bail!(msg);
        }
        Ok(())
    }
}

impl Sim {
    pub fn begin_capture(&self) -> Result<()> {
        let mut st = self.state();
        if let Some(c) = &st.capture {
            // One capture per device at a time (a GPU allows one per stream; the glue needs one).
            bail!("{}: a capture of the {} stream is already in progress", self.name(), c.stream.name());
        }
        st.capture = Some(Capture {
            stream: current_stream(),
            thread: std::thread::current().id(),
            ops: Vec::new(),
            refused: None,
        });
        Ok(())
    }

    pub fn end_capture(&self) -> Result<Graph> {
        let mut st = self.state();
        let Some(c) = st.capture.take() else { bail!("{}: end of a capture that was never begun", self.name()) };
        if c.stream != current_stream() || c.thread != std::thread::current().id() {
            let s = c.stream;
            st.capture = Some(c);
            bail!("{}: the capture of the {} stream ended from another stream or thread", self.name(), s.name());
        }
        if let Some(e) = c.refused {
            bail!(e);
        }
        let mut starts: Vec<u64> = c.ops.iter().flat_map(|(_, u)| u.iter().copied()).collect();
        starts.sort_unstable();
        starts.dedup();
        let allocs = starts.iter().filter_map(|&a| st.allocs.get(&a).map(|x| (a, x.bytes))).collect();
        Ok(Graph::Sim(SimGraph { ordinal: self.ordinal, ops: c.ops, allocs }))
    }

    pub fn replay(&self, g: &SimGraph) -> Result<()> {
        if g.ordinal != self.ordinal {
            bail!("{}: replay of a graph captured on cuda-sim:{}", self.name(), g.ordinal);
        }
        let mut st = self.state();
        st.refuse_in_capture(&self.name(), "a graph replay")?;
        for &(a, bytes) in &g.allocs {
            if st.allocs.get(&a).map(|x| x.bytes) != Some(bytes) {
                bail!(
                    "{}: graph replay: the allocation of {bytes} bytes at {a:#x} that the graph uses was freed since \
                     its capture (a graph must own or outlive every buffer it reads or writes)",
                    self.name()
                );
            }
        }
        let s = current_stream() as usize;
        for (op, uses) in &g.ops {
            let seq = st.queued[s];
            st.queues[s].push_back(super::Entry { op: op.clone(), seq, uses: uses.clone() });
            st.queued[s] += 1;
        }
        Ok(())
    }
}
