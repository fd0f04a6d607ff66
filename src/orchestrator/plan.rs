//! The plan of a run before anything starts: which devices (and how many threads or GPUs),
//! the collective between the training devices, the engine sizes and sampling settings taken
//! from the job, and the reference rollouts of SFT.
//!
//! Owns: nothing. May call: `crate::config`, `crate::device`, `crate::parallel`, `crate::engine`
//! and `crate::data` (sampling settings, reference rollouts). Must not: open a device other
//! than to count the visible GPUs.

use crate::config::JobConfig;
use crate::data::dataset::PromptItem;
use crate::device::DeviceSpec;
use crate::engine::rollout::Rollout;
use crate::engine::{EngineConfig, SamplingConfig};
use crate::parallel::{Collective, InProcess};
use anyhow::{bail, Result};
use std::sync::Arc;

/// The engine sizes of a job's rollouts.
pub fn engine_config(job: &JobConfig) -> EngineConfig {
    let r = &job.rollout;
    EngineConfig {
        max_seqs: r.max_seqs,
        max_tokens_per_step: r.max_tokens_per_step,
        kv_cache_bytes: r.kv_cache_mb << 20,
        cuda_graphs: r.cuda_graphs,
        ..Default::default()
    }
}

/// The devices of a run: (name, threads per CPU device or 0 for CUDA) × N. `cpu` splits the
/// cores evenly (an error when there are more devices than cores); `cpu:T` gives each device T
/// threads (oversubscription is the user's choice); `cuda`/`cuda:K` takes N GPUs from K on (all
/// visible ones for N = 0); `cuda-sim`/`cuda-sim:K` N simulated GPUs from K on (one for N = 0).
pub fn plan_devices(spec: &str, n: usize) -> Result<Vec<String>> {
    let cores = std::thread::available_parallelism().map(|c| c.get()).unwrap_or(1);
    let first = match DeviceSpec::parse(spec).map_err(|e| anyhow::anyhow!("run.device: {e:#}"))? {
        DeviceSpec::Cpu { threads: None } => {
            let n = n.max(1);
            if n > cores {
                bail!(
                    "run.devices = {n} CPU devices, but this machine has {cores} cores: a CPU device needs at least one (set run.device = \"cpu:T\" to choose threads per device yourself)"
                );
            }
            return Ok((0..n).map(|_| format!("cpu:{}", cores / n)).collect());
        }
        DeviceSpec::Cpu { threads: Some(t) } => return Ok((0..n.max(1)).map(|_| format!("cpu:{t}")).collect()),
        DeviceSpec::Cuda { ordinal } => ordinal.unwrap_or(0),
        DeviceSpec::CudaSim { ordinal } => {
            let first = ordinal.unwrap_or(0);
            // One simulated GPU unless N is given (the simulator is a correctness tool: every
            // device runs on the same host cores); more than there are is refused.
            let count = crate::device::CudaDevice::sim_count()?.saturating_sub(first);
            let n = n.max(1);
            if n > count {
                bail!(
                    "run.devices = {n} simulated GPUs from cuda-sim:{first}, but the simulator has {count} from there \
                     (COLOTRAIN_SIM_DEVICES)"
                );
            }
            return Ok((first..first + n).map(|k| format!("cuda-sim:{k}")).collect());
        }
    };
    // All visible GPUs (CUDA_VISIBLE_DEVICES decides what is visible) unless N is given; N more
    // than are visible is refused here, naming what is. (Built without CUDA, opening the first
    // device later says so.)
    let visible = || (first..first + 64).take_while(|&k| crate::device::Device::cuda(k).is_ok()).count();
    let n = if n > 0 {
        if cfg!(feature = "cuda") {
            if let Err(e) = crate::device::Device::cuda(first + n - 1) {
                bail!(
                    "run.devices = {n} GPUs from cuda:{first}, but {} visible from there (CUDA_VISIBLE_DEVICES={}): cuda:{} cannot be opened: {e:#}",
                    visible(),
                    std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into()),
                    first + n - 1
                );
            }
        }
        n
    } else {
        visible().max(1)
    };
    Ok((first..first + n).map(|k| format!("cuda:{k}")).collect())
}

/// The collective of the training devices `names`: in-process (the default: training runs on
/// the host, so host memory needs no copies), or NCCL across their GPUs with
/// COLOTRAIN_COLLECTIVE=nccl (feature `cuda`).
pub fn collective(names: &[String]) -> Result<Arc<dyn Collective>> {
    match std::env::var("COLOTRAIN_COLLECTIVE").as_deref() {
        Err(_) | Ok("") | Ok("inprocess") => Ok(Arc::new(InProcess::new(names.len())?)),
        Ok("nccl") => {
            let ords: Vec<usize> = names
                .iter()
                .map(|n| n.strip_prefix("cuda:").and_then(|k| k.parse().ok()))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    anyhow::anyhow!("COLOTRAIN_COLLECTIVE=nccl needs CUDA training devices, got {names:?}")
                })?;
            nccl_group(&ords)
        }
        Ok(other) => bail!("COLOTRAIN_COLLECTIVE='{other}': expected 'inprocess' (the default) or 'nccl'"),
    }
}

/// The device collective of the training devices `names` (ZeRO-1 on the GPUs' own memory),
/// for several CUDA or simulated GPUs: NCCL on their buffers (`train::device_nccl`, the
/// default; on the simulator its calls run between simulated devices), or the in-process peer
/// copies of `train::device_coll::PeerCopy` with COLOTRAIN_DEVICE_COLLECTIVE=peer. None for one
/// device, for CPU devices, and under COLOTRAIN_COLLECTIVE=nccl (which keeps the host-staged
/// NCCL path for the trainers).
pub fn device_collective(
    names: &[String],
    on_cpu: bool,
) -> Result<Option<Arc<dyn crate::train::device_coll::DeviceCollective>>> {
    let nccl = std::env::var("COLOTRAIN_COLLECTIVE").as_deref() == Ok("nccl");
    if on_cpu || names.len() < 2 || nccl {
        return Ok(None);
    }
    if peer_requested()? {
        Ok(Some(Arc::new(crate::train::device_coll::PeerCopy::new(names.len())?)))
    } else {
        let devs = cuda_devices(names.iter(), "the device collective")?;
        Ok(Some(Arc::new(crate::train::device_nccl::NcclDevice::new(&devs)?)))
    }
}

/// The CUDA (or simulated) devices `names`, for the NCCL group `what`.
fn cuda_devices<'a>(
    names: impl Iterator<Item = &'a String>,
    what: &str,
) -> Result<Vec<crate::device::cuda::CudaDevice>> {
    names
        .map(|n| match crate::device::Device::parse(n)? {
            crate::device::Device::Cuda(c) => Ok(c),
            _ => bail!("{what}: {n} is not a CUDA device"),
        })
        .collect()
}

/// Whether COLOTRAIN_DEVICE_COLLECTIVE asks for the in-process peer copies ('peer') rather
/// than NCCL ('nccl', the default), for the trainers' ZeRO-1 and a split placement's
/// publishing alike; another value is an error.
fn peer_requested() -> Result<bool> {
    match std::env::var("COLOTRAIN_DEVICE_COLLECTIVE").as_deref() {
        Err(_) | Ok("") | Ok("nccl") => Ok(false),
        Ok("peer") => Ok(true),
        Ok(other) => bail!("COLOTRAIN_DEVICE_COLLECTIVE='{other}': expected 'nccl' (the default) or 'peer'"),
    }
}

/// Whether a split placement on GPUs publishes each version by NCCL broadcast (the default)
/// rather than through a snapshot the generators copy from (COLOTRAIN_DEVICE_COLLECTIVE=peer).
/// (An invalid value fails the run in `publish_group` first.)
pub fn publishes_by_broadcast() -> bool {
    !peer_requested().unwrap_or(false)
}

/// A split placement's publishing group on GPUs: the lead trainer `names[gens]` (rank 0) and
/// the generators `names[..gens]` (rank 1 + slot), one NCCL communicator each
/// (`orchestrator::mailbox`). None on CPU devices, colocated, or under
/// COLOTRAIN_DEVICE_COLLECTIVE=peer.
pub fn publish_group(
    names: &[String],
    gens: usize,
    on_cpu: bool,
) -> Result<Option<Arc<crate::train::device_nccl::NcclDevice>>> {
    if on_cpu || gens == 0 || gens >= names.len() || peer_requested()? {
        return Ok(None);
    }
    let devs =
        cuda_devices(std::iter::once(&names[gens]).chain(&names[..gens]), "the split placement's publishing group")?;
    Ok(Some(Arc::new(crate::train::device_nccl::NcclDevice::new(&devs)?)))
}

#[cfg(feature = "cuda")]
fn nccl_group(ords: &[usize]) -> Result<Arc<dyn Collective>> {
    Ok(Arc::new(crate::parallel::nccl::Nccl::new(ords)?))
}

#[cfg(not(feature = "cuda"))]
fn nccl_group(_ords: &[usize]) -> Result<Arc<dyn Collective>> {
    bail!("COLOTRAIN_COLLECTIVE=nccl: this binary was built without --features cuda")
}

/// The rollout sampling settings of a job.
pub fn sampling_of(job: &JobConfig) -> SamplingConfig {
    SamplingConfig {
        temperature: job.rollout.temperature,
        top_p: job.rollout.top_p,
        top_k: job.rollout.top_k,
        max_new_tokens: job.rollout.max_new_tokens,
        stop: Vec::new(),
        ignore_eos: false,
        seed: job.run.seed,
        topk_logprobs: if job.objective.centering { job.objective.centering_top_k } else { 0 },
    }
}

/// SFT on reference responses (teacher forcing on the dataset's answers).
pub fn reference_rollouts(prompts: &[PromptItem], samples: usize) -> Vec<Rollout> {
    let mut out = Vec::new();
    for p in prompts {
        let resp = p.response.clone().unwrap_or_default();
        for s in 0..samples.max(1) {
            out.push(Rollout {
                prompt_id: p.id,
                sample: s as u32,
                group: p.id,
                prompt: p.tokens.clone(),
                sampler_logprobs: vec![0.0; resp.len()],
                response: resp.clone(),
                answer: p.answer.clone(),
                ..Default::default()
            });
        }
    }
    out
}
