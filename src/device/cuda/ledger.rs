//! The launch ledger of a CUDA device (a GPU or the simulator): every typed kernel launcher,
//! GEMM, copy and collective copy declares its FLOPs and bytes from its shapes ([`Cost`], the
//! arithmetic in `cost.rs`), and the device adds them up per (phase, stream, operation) with
//! each launch's roofline time on the GPUs the project models ([`GPUS`]: max(FLOPs / peak at
//! the operation's precision, bytes / the bandwidth of the path they take), summed over
//! launches, nothing overlapped). The phase is the calling thread's (`parallel::phase`: the
//! workers name each command's phase). A CUDA-graph capture keeps its launches' costs with the
//! graph ([`Captured`]) and every replay adds them, so a replayed decode step counts what the
//! same step launched eagerly counts.
//!
//! It is a model of the work, not a measurement: on the simulator it tells where a GPU's time
//! would go, and what the code launches that the step's arithmetic does not need.
//!
//! Owns: [`Cost`], [`Ledger`], [`Gpu`] and the modelled GPUs, and the device's recording ([`CudaDevice::record`], the capture's list, replays). May call: the
//! device's ledger fields and its capture state. Must not: read device memory or time
//! anything (costs come from host-side shapes).

use super::driver::{current_stream, Stream};
use super::CudaDevice;
use crate::parallel::phase::current_phase;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// One GPU's dense peak rates and bandwidths (vendor figures, REFERENCES.md; FP32 is the
/// CUDA cores' rate: the GEMMs run CUBLAS_COMPUTE_32F, never TF32).
#[derive(Clone, Copy, Debug)]
pub struct Gpu {
    pub name: &'static str,
    pub f32_tflops: f64,
    pub bf16_tflops: f64,
    pub fp8_tflops: f64,
    /// None: no FP4 tensor cores (Hopper emulates NVFP4: the ledger sees the emulation's own
    /// launches, and an FP4 GEMM, were one launched, counts at the BF16 rate).
    pub fp4_tflops: Option<f64>,
    pub hbm_tbs: f64,
    /// NVLink bandwidth per direction, GB/s.
    pub nvlink_gbs: f64,
    /// PCIe bandwidth per direction, GB/s (Gen5 x16).
    pub pcie_gbs: f64,
    /// HBM capacity, GB (10⁹ bytes, the vendor's figure; what a process can allocate is a
    /// little less, and the memory plan keeps its own margin).
    pub hbm_gb: f64,
    /// Streaming multiprocessors: a kernel launch of fewer blocks leaves the others idle
    /// ([`Cost::seconds`]).
    pub sms: u32,
}

pub const H200: Gpu = Gpu {
    name: "H200",
    f32_tflops: 67.0,
    bf16_tflops: 989.0,
    fp8_tflops: 1979.0,
    fp4_tflops: None,
    hbm_tbs: 4.8,
    nvlink_gbs: 450.0,
    pcie_gbs: 64.0,
    hbm_gb: 141.0,
    sms: 132,
};
pub const B300: Gpu = Gpu {
    name: "B300",
    f32_tflops: 75.0,
    bf16_tflops: 2250.0,
    fp8_tflops: 4500.0,
    fp4_tflops: Some(13000.0),
    hbm_tbs: 8.0,
    nvlink_gbs: 900.0,
    pcie_gbs: 64.0,
    hbm_gb: 288.0,
    // The simulator's sm_100a (a B200's count; the full Blackwell Ultra die has 160).
    sms: 148,
};
/// The GPUs every launch is timed for, in the order of [`Entry::seconds`].
pub const GPUS: [Gpu; 2] = [H200, B300];

/// The precision a launch's FLOPs run at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Rate {
    /// CUDA cores, FP32 (element-wise kernels, FP32 GEMMs).
    F32,
    /// Tensor cores, BF16 or F16 operands.
    Bf16,
    Fp8,
    Fp4,
}

/// Where a launch's bytes move.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Path {
    /// Device memory (read + written).
    Hbm,
    /// GPU to GPU (peer copies).
    Nvlink,
    /// Host to device or device to host.
    Pcie,
}

/// What one launch declares: FLOPs at `rate`, bytes over `path`, and for one of this
/// project's kernels the blocks of its grid.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cost {
    pub flops: f64,
    pub bytes: f64,
    pub rate: Rate,
    pub path: Path,
    /// The launch's blocks (`kernels.rs` sets them from the grid); None for a library's
    /// launch (cuBLASLt, CUTLASS, NCCL, copies), which sizes its grid to the GPU.
    pub blocks: Option<u64>,
}

impl Cost {
    /// Element-wise or reduction work: FLOPs on the CUDA cores, bytes through HBM.
    pub fn hbm(flops: f64, bytes: f64) -> Cost {
        Cost { flops, bytes, rate: Rate::F32, path: Path::Hbm, blocks: None }
    }

    /// This cost for a launch of `blocks` blocks.
    pub fn on_blocks(self, blocks: u64) -> Cost {
        Cost { blocks: Some(blocks), ..self }
    }

    /// The fraction of `g`'s SMs this launch occupies: min(1, blocks / SMs). A block runs on
    /// one SM, so a grid of fewer blocks than SMs leaves the rest idle, and the model gives
    /// each SM its share of the peak rates and bandwidths (a model: one SM alone can draw a
    /// few times its share of HBM bandwidth, so it overstates such a launch's time by that
    /// much, and it does not model partial last waves).
    pub fn occupancy(&self, g: &Gpu) -> f64 {
        self.blocks.map_or(1.0, |b| (b as f64 / g.sms as f64).min(1.0))
    }

    /// The roofline seconds of this launch on `g`, divided by its [`Cost::occupancy`].
    pub fn seconds(&self, g: &Gpu) -> f64 {
        let tflops = match self.rate {
            Rate::F32 => g.f32_tflops,
            Rate::Bf16 => g.bf16_tflops,
            Rate::Fp8 => g.fp8_tflops,
            Rate::Fp4 => g.fp4_tflops.unwrap_or(g.bf16_tflops),
        };
        let bw = match self.path {
            Path::Hbm => g.hbm_tbs * 1e12,
            Path::Nvlink => g.nvlink_gbs * 1e9,
            Path::Pcie => g.pcie_gbs * 1e9,
        };
        (self.flops / (tflops * 1e12)).max(self.bytes / bw) / self.occupancy(g)
    }
}

/// The totals of one (phase, stream, operation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Entry {
    pub launches: u64,
    pub flops: f64,
    pub bytes: f64,
    /// Σ over the launches of each launch's roofline seconds on [`GPUS`] (H200, B300).
    pub seconds: [f64; 2],
    /// Of the launches, those replayed from a CUDA graph.
    pub replayed: u64,
    /// The (rate, path) of the operation's launches (an operation has one of each).
    pub kind: Option<(Rate, Path)>,
}

impl Entry {
    fn add(&mut self, c: &Cost, replayed: bool) {
        self.kind.get_or_insert((c.rate, c.path));
        self.launches += 1;
        self.replayed += replayed as u64;
        self.flops += c.flops;
        self.bytes += c.bytes;
        for (s, g) in self.seconds.iter_mut().zip(GPUS.iter()) {
            *s += c.seconds(g);
        }
    }

    /// Its bytes as [HBM, NVLink, PCIe], by the path its operation takes.
    pub fn bytes_by_path(&self) -> [f64; 3] {
        match self.kind.map(|k| k.1).unwrap_or(Path::Hbm) {
            Path::Hbm => [self.bytes, 0.0, 0.0],
            Path::Nvlink => [0.0, self.bytes, 0.0],
            Path::Pcie => [0.0, 0.0, self.bytes],
        }
    }

    pub fn merge(&mut self, o: &Entry) {
        if let Some(k) = o.kind {
            self.kind.get_or_insert(k);
        }
        self.launches += o.launches;
        self.replayed += o.replayed;
        self.flops += o.flops;
        self.bytes += o.bytes;
        for (s, t) in self.seconds.iter_mut().zip(o.seconds.iter()) {
            *s += t;
        }
    }
}

/// (phase, stream, operation): the ledger's key.
pub type Key = (&'static str, Stream, &'static str);

/// One device's ledger: the totals per key since the last [`Ledger::take`].
#[derive(Debug, Default)]
pub struct Ledger {
    entries: HashMap<Key, Entry>,
}

impl Ledger {
    /// One launch (one hash-map update: the device's hot path).
    pub fn record(&mut self, key: Key, c: &Cost, replayed: bool) {
        self.entries.entry(key).or_default().add(c, replayed);
    }

    /// The totals so far, and an empty ledger in their place.
    pub fn take(&mut self) -> Ledger {
        std::mem::take(self)
    }

    pub fn entries(&self) -> impl Iterator<Item = (&Key, &Entry)> {
        self.entries.iter()
    }

    /// The (rate, path) an operation was recorded with.
    pub fn kind(&self, op: &str) -> Option<(Rate, Path)> {
        self.entries.iter().find(|(k, _)| k.2 == op).and_then(|(_, e)| e.kind)
    }

    /// The totals of each phase (both streams, every operation), by phase name.
    pub fn phases(&self) -> BTreeMap<&'static str, Entry> {
        let mut out: BTreeMap<&'static str, Entry> = BTreeMap::new();
        for ((phase, _, _), e) in &self.entries {
            out.entry(phase).or_default().merge(e);
        }
        out
    }

    /// The totals of every phase, stream and operation.
    pub fn total(&self) -> Entry {
        let mut t = Entry::default();
        for (_, e) in sorted(self) {
            t.merge(e);
        }
        t
    }

    /// Adds `o` into this ledger.
    pub fn absorb(&mut self, o: Ledger) {
        for (k, e) in o.entries {
            self.entries.entry(k).or_default().merge(&e);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl Cost {
    /// This cost plus `keys` times `per_key` (attention, whose work grows with the keys read).
    fn plus_keys(&self, per_key: &Cost, keys: u64) -> Cost {
        let k = keys as f64;
        Cost { flops: self.flops + k * per_key.flops, bytes: self.bytes + k * per_key.bytes, ..*self }
    }
}

/// One phase of one step in the metrics: the launches of every device, their FLOPs and bytes
/// by path (summed over the devices), and the roofline seconds of the slowest device (the
/// phase ends when it does).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PhaseSummary {
    pub launches: u64,
    pub flops: f64,
    /// Device-memory bytes.
    pub bytes: f64,
    pub nvlink_bytes: f64,
    pub pcie_bytes: f64,
    pub h200_s: f64,
    pub b300_s: f64,
}

/// The entries of `l` in a fixed order (so sums of seconds do not depend on hash order).
fn sorted(l: &Ledger) -> Vec<(&Key, &Entry)> {
    let mut v: Vec<_> = l.entries().collect();
    v.sort_by(|a, b| a.0.cmp(b.0));
    v
}

/// The step's [`PhaseSummary`] per phase over the devices' ledgers.
pub fn summarize(devices: &[Ledger]) -> BTreeMap<String, PhaseSummary> {
    let mut out: BTreeMap<String, PhaseSummary> = BTreeMap::new();
    for l in devices {
        let mut secs: BTreeMap<&str, [f64; 2]> = BTreeMap::new();
        for ((phase, _, _), e) in sorted(l) {
            let s = out.entry(phase.to_string()).or_default();
            s.launches += e.launches;
            s.flops += e.flops;
            let [hbm, nvlink, pcie] = e.bytes_by_path();
            (s.bytes, s.nvlink_bytes, s.pcie_bytes) = (s.bytes + hbm, s.nvlink_bytes + nvlink, s.pcie_bytes + pcie);
            let t = secs.entry(phase).or_default();
            t[0] += e.seconds[0];
            t[1] += e.seconds[1];
        }
        for (phase, t) in secs {
            if let Some(s) = out.get_mut(phase) {
                s.h200_s = s.h200_s.max(t[0]);
                s.b300_s = s.b300_s.max(t[1]);
            }
        }
    }
    out
}

/// One row of `ledger.json`: an operation of a phase on a stream, over a whole run.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub phase: String,
    pub stream: &'static str,
    pub op: &'static str,
    pub rate: Rate,
    pub path: Path,
    pub launches: u64,
    pub replayed: u64,
    pub flops: f64,
    pub bytes: f64,
    pub h200_s: f64,
    pub b300_s: f64,
}

/// The rows of `l`, the costliest on an H200 first.
pub fn rows(l: &Ledger) -> Vec<Row> {
    let mut v: Vec<Row> = sorted(l)
        .into_iter()
        .map(|((phase, stream, op), e)| {
            let (rate, path) = e.kind.unwrap_or((Rate::F32, Path::Hbm));
            Row {
                phase: phase.to_string(),
                stream: stream.name(),
                op,
                rate,
                path,
                launches: e.launches,
                replayed: e.replayed,
                flops: e.flops,
                bytes: e.bytes,
                h200_s: e.seconds[0],
                b300_s: e.seconds[1],
            }
        })
        .collect();
    v.sort_by(|a, b| b.h200_s.total_cmp(&a.h200_s));
    v
}

/// One launch a CUDA-graph capture recorded: its stream, operation and cost, and for
/// attention the cost of each key read (a replay's keys are the replaying step's, not the
/// capture's: [`CudaDevice::record_replay`]).
#[derive(Clone, Copy, Debug)]
pub struct CapturedLaunch {
    pub stream: Stream,
    pub op: &'static str,
    /// Without the keys' part when `per_key` is set.
    pub cost: Cost,
    pub per_key: Option<Cost>,
}

/// The launches of one capture, in order.
pub type Captured = Vec<CapturedLaunch>;

impl CudaDevice {
    /// Adds one launch of `op` to the ledger under the calling thread's phase and stream; while
    /// this thread captures the compute stream, to the capture's list instead (nothing runs
    /// then: the replays count it).
    pub(super) fn record(&self, op: &'static str, cost: Cost) {
        self.record_launch(op, cost, None)
    }

    /// [`CudaDevice::record`] for a launch that reads `keys` keys at `per_key` each on top of `base`.
    pub(super) fn record_keyed(&self, op: &'static str, base: Cost, per_key: Cost, keys: u64) {
        self.record_launch(op, base, Some((per_key, keys)))
    }

    fn record_launch(&self, op: &'static str, base: Cost, per_key: Option<(Cost, u64)>) {
        let stream = current_stream();
        if stream == Stream::Compute && self.captures_here() {
            let l = CapturedLaunch { stream, op, cost: base, per_key: per_key.map(|p| p.0) };
            self.inner.captured.lock().unwrap_or_else(|e| e.into_inner()).push(l);
            return;
        }
        let cost = match per_key {
            Some((k, n)) => base.plus_keys(&k, n),
            None => base,
        };
        self.ledger().record((current_phase(), stream, op), &cost, false);
    }

    /// The launches recorded since the capture began (graph.rs takes them into the graph).
    pub(super) fn take_captured(&self) -> Captured {
        std::mem::take(&mut *self.inner.captured.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Adds a replay of the captured `list` under the calling thread's phase, its attention
    /// launches reading `keys` keys each.
    pub(super) fn record_replay(&self, list: &Captured, keys: u64) {
        let phase = current_phase();
        let mut l = self.ledger();
        for c in list {
            let cost = match &c.per_key {
                Some(k) => c.cost.plus_keys(k, keys),
                None => c.cost,
            };
            l.record((phase, c.stream, c.op), &cost, true);
        }
    }

    /// This device's ledger since the last time it was taken; it then starts empty.
    pub fn take_ledger(&self) -> Ledger {
        self.ledger().take()
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.inner.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A launch's roofline time is the larger of its compute and memory times, at the rate of
    /// its precision and the bandwidth of its path (hand arithmetic from the vendor figures).
    #[test]
    fn a_launch_takes_the_larger_of_its_compute_and_memory_times() {
        // 2·4096³ FLOPs of BF16 on an H200: 137.4 GFLOP / 989 TFLOP/s = 139 µs; its 3 × 32 MiB of
        // operands at 4.8 TB/s take 21 µs.
        let g = Cost {
            flops: 2.0 * 4096f64.powi(3),
            bytes: 3.0 * 4096.0 * 4096.0 * 2.0,
            rate: Rate::Bf16,
            path: Path::Hbm,
            blocks: None,
        };
        let want = 2.0 * 4096f64.powi(3) / 989e12;
        assert!((g.seconds(&H200) - want).abs() <= 1e-15 + 1e-12 * want);
        // The same GEMM in FP8 on a B300 is still compute-bound: 137.4e9 / 4.5e15.
        let f8 = Cost { rate: Rate::Fp8, ..g };
        assert!((f8.seconds(&B300) - 2.0 * 4096f64.powi(3) / 4500e12).abs() <= 1e-18 + 1e-12 * f8.seconds(&B300));
        // FP4 on Hopper counts at the BF16 rate; on Blackwell at its own.
        let f4 = Cost { rate: Rate::Fp4, ..g };
        assert_eq!(f4.seconds(&H200), g.seconds(&H200));
        assert!(f4.seconds(&B300) < f8.seconds(&B300));
        // An element-wise pass over 1 GB is memory-bound: 1e9 / 4.8e12.
        let e = Cost::hbm(1e8, 1e9);
        assert!((e.seconds(&H200) - 1e9 / 4.8e12).abs() <= 1e-18 + 1e-12 * 1e9 / 4.8e12);
        // A peer copy of 450 MB takes 1 ms over an H200's NVLink; over PCIe 7 ms.
        let p = Cost { flops: 0.0, bytes: 450e6, rate: Rate::F32, path: Path::Nvlink, blocks: None };
        assert!((p.seconds(&H200) - 1e-3).abs() <= 1e-15);
        let h = Cost { path: Path::Pcie, ..p };
        assert!((h.seconds(&H200) - 450e6 / 64e9).abs() <= 1e-15);
    }

    /// A launch of fewer blocks than the GPU has SMs gets their share of its rates: one block
    /// of a 1 GB column reduction takes 132 × 1e9 / 4.8e12 = 27.5 ms on an H200 (148 × on a
    /// B300); from 132 blocks on it is the full roofline.
    #[test]
    fn a_launch_of_few_blocks_gets_only_their_share_of_the_gpu() {
        let full = Cost::hbm(0.0, 1e9);
        let one = full.on_blocks(1);
        let want = 132.0 * 1e9 / 4.8e12;
        assert!((one.seconds(&H200) - want).abs() <= 1e-15 + 1e-12 * want);
        let want = 148.0 * 1e9 / 8e12;
        assert!((one.seconds(&B300) - want).abs() <= 1e-15 + 1e-12 * want);
        let ten = full.on_blocks(10);
        assert!((ten.seconds(&H200) - 13.2 * 1e9 / 4.8e12).abs() <= 1e-15 + 1e-12 * ten.seconds(&H200));
        for b in [132, 133, 2112] {
            assert_eq!(full.on_blocks(b).seconds(&H200), full.seconds(&H200), "{b} blocks");
        }
        assert_eq!(full.on_blocks(140).occupancy(&B300), 140.0 / 148.0);
    }

    /// Recording adds launches, FLOPs, bytes and seconds per key; `take` empties the ledger;
    /// `phases` sums both streams and every operation of a phase.
    #[test]
    fn the_ledger_adds_up_per_key_and_per_phase() {
        let mut l = Ledger::default();
        let a = Cost::hbm(10.0, 100.0);
        let b = Cost { flops: 1e6, bytes: 8.0, rate: Rate::Bf16, path: Path::Hbm, blocks: None };
        l.record(("train", Stream::Compute, "ct_swiglu"), &a, false);
        l.record(("train", Stream::Compute, "ct_swiglu"), &a, true);
        l.record(("train", Stream::Comm, "ct_col_sum"), &b, false);
        l.record(("rollout", Stream::Compute, "ct_swiglu"), &a, false);
        let e = l.entries().find(|(k, _)| **k == ("train", Stream::Compute, "ct_swiglu")).map(|(_, e)| *e).unwrap();
        assert_eq!((e.launches, e.replayed, e.flops, e.bytes), (2, 1, 20.0, 200.0));
        assert!((e.seconds[0] - 2.0 * 100.0 / 4.8e12).abs() <= 1e-24);
        let p = l.phases();
        assert_eq!(p.len(), 2);
        assert_eq!((p["train"].launches, p["train"].flops, p["train"].bytes), (3, 1e6 + 20.0, 208.0));
        assert_eq!(l.kind("ct_col_sum"), Some((Rate::Bf16, Path::Hbm)));
        let taken = l.take();
        assert!(l.is_empty() && !taken.is_empty());
        let mut sum = Ledger::default();
        sum.absorb(taken);
        assert_eq!(sum.phases()["rollout"].launches, 1);
    }
}
