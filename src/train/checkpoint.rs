//! Checkpoints: a Hugging Face directory that transformers loads (config.json, model.safetensors,
//! tokenizer files) plus the trainer's state (optimizer.safetensors: FP32 master weights and Adam
//! moments; trainer_state.json: counters and the run's fingerprint). Written into a temporary
//! directory, every file fsynced, then renamed into place: a checkpoint is either whole or absent,
//! and an existing one is never overwritten.

use super::trainer::Trainer;
use crate::config::{CheckpointDtype, JobConfig};
use crate::device::DType;
use crate::model::weights::{write_safetensors, OwnedView};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const STATE_FILE: &str = "trainer_state.json";
const OPT_FILE: &str = "optimizer.safetensors";

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TrainerState {
    pub format: u32,
    pub step: u64,
    pub version: u64,
    pub optimizer_step: u64,
    pub skipped_steps: u64,
    pub num_params: usize,
    /// Hash of the run-defining config (everything but run.steps, eval and checkpoint policy).
    pub fingerprint: String,
    pub config: String,
}

/// `[rollout]` settings that change how a run executes, not what it is (the same model, data
/// and objective; on the simulator `tests/sim.rs` and `tests/sim_node.rs` show the same samples
/// and weights either way, while on a GPU another GEMM kernel may change last bits, as resuming
/// on other devices may): a run resumes with them changed. Their lines are left out of the
/// config's TOML before it is hashed, which also keeps the fingerprints of checkpoints written
/// before a setting existed.
const EXECUTION_ONLY: &[&str] = &["cuda_graphs", "kv_release"];

/// The fingerprint of a run: configs that differ only in length, evaluation or checkpoint
/// policy (or out_dir), where they run, or an [`EXECUTION_ONLY`] setting describe the same run.
pub fn fingerprint(job: &JobConfig) -> String {
    hash_without(job, EXECUTION_ONLY)
}

/// Whether a checkpoint's fingerprint `fp` belongs to `job`'s run: this release's, or the one
/// before `rollout.kv_release`, which hashed `cuda_graphs` in (either value).
fn belongs(fp: &str, job: &JobConfig) -> bool {
    if fp == fingerprint(job) {
        return true;
    }
    [true, false].into_iter().any(|graphs| {
        let mut j = job.clone();
        j.rollout.cuda_graphs = graphs;
        fp == hash_without(&j, &["kv_release"])
    })
}

fn hash_without(job: &JobConfig, skip: &[&str]) -> String {
    let mut j = job.clone();
    j.run.steps = 0;
    j.run.out_dir = None;
    // Where it runs is not what it is: a run may resume on other devices.
    j.run.device = String::new();
    j.run.devices = 0;
    j.run.memory_budget_mb = None;
    j.eval = Default::default();
    j.checkpoint = Default::default();
    // Only `[rollout]`'s own lines are left out (a multi-line string elsewhere may hold text
    // that looks like a key).
    let mut table = "";
    let toml: String = j
        .to_toml()
        .lines()
        .filter(|l| {
            if l.starts_with('[') {
                table = l.trim();
            }
            table != "[rollout]" || !skip.iter().any(|k| l.split('=').next().map(str::trim) == Some(*k))
        })
        .flat_map(|l| [l, "\n"])
        .collect();
    format!("{:016x}", crate::rand::fnv1a64(toml.as_bytes()))
}

pub fn dir_name(step: u64) -> String {
    format!("checkpoint-{step:06}")
}

fn f32_view(v: &[f32]) -> OwnedView {
    OwnedView {
        dtype: safetensors::Dtype::F32,
        shape: vec![v.len()],
        bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

fn fsync_dir(d: &Path) {
    if let Ok(f) = std::fs::File::open(d) {
        let _ = f.sync_all();
    }
}

/// The optimizer state of a checkpoint, gathered over devices (`Trainer::gather_state`).
pub struct OptState {
    pub master: Vec<f32>,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

/// What else a checkpoint holds so a resumed run continues exactly: the RL monitor's state
/// (`monitor.json`) and a stale engine's older weight versions (`stale_ring.safetensors`).
pub const MONITOR_FILE: &str = "monitor.json";
/// The mismatch guard's state (`mismatch::guard::GuardState`), when the run has a guard.
pub const GUARD_FILE: &str = "guard.json";
pub const RING_FILE: &str = "stale_ring.safetensors";

/// Writes checkpoint `step` of `trainer` into `out_dir` (with the gathered optimizer state `o`
/// and the files `extra`, name → bytes); `text_dir` provides the tokenizer files. Everything is
/// written into a temporary folder that is renamed into place.
pub fn save(
    out_dir: &Path,
    step: u64,
    trainer: &Trainer,
    o: &OptState,
    job: &JobConfig,
    text_dir: Option<&Path>,
    extra: &[(&str, Vec<u8>)],
) -> Result<PathBuf> {
    let final_dir = out_dir.join(dir_name(step));
    if final_dir.exists() {
        bail!("{} already exists; refusing to overwrite a checkpoint", final_dir.display());
    }
    let tmp = out_dir.join(format!(".{}.tmp-{}", dir_name(step), std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).with_context(|| format!("cannot clear {}", tmp.display()))?;
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
    let dtype = match job.checkpoint.dtype {
        CheckpointDtype::F32 => DType::F32,
        CheckpointDtype::Bf16 => DType::BF16,
    };
    trainer.weights.save(&trainer.cfg, &tmp, dtype)?;
    let torch = if dtype == DType::F32 { "float32" } else { "bfloat16" };
    crate::util::write_atomic(
        &tmp.join("config.json"),
        serde_json::to_string_pretty(&trainer.cfg.to_hf_json(torch))?.as_bytes(),
    )?;
    if let Some(src) = text_dir {
        for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"] {
            let p = src.join(f);
            if p.exists() {
                let bytes = std::fs::read(&p).with_context(|| format!("cannot read {}", p.display()))?;
                crate::util::write_atomic(&tmp.join(f), &bytes)?;
            }
        }
    }
    let mut views = vec![("master".to_string(), f32_view(&o.master))];
    if !o.m.is_empty() {
        views.push(("exp_avg".to_string(), f32_view(&o.m)));
        views.push(("exp_avg_sq".to_string(), f32_view(&o.v)));
    }
    write_safetensors(&tmp.join(OPT_FILE), views, None)?;
    for (name, bytes) in extra {
        crate::util::write_atomic(&tmp.join(name), bytes)?;
    }
    let state = TrainerState {
        format: 1,
        step,
        version: trainer.version,
        optimizer_step: trainer.opt.step,
        skipped_steps: trainer.skipped_steps,
        num_params: o.master.len(),
        fingerprint: fingerprint(job),
        config: job.to_toml(),
    };
    crate::util::write_atomic(&tmp.join(STATE_FILE), serde_json::to_string_pretty(&state)?.as_bytes())?;
    fsync_dir(&tmp);
    std::fs::rename(&tmp, &final_dir)
        .with_context(|| format!("cannot rename {} to {}", tmp.display(), final_dir.display()))?;
    fsync_dir(out_dir);
    Ok(final_dir)
}

/// Removes all but the newest `keep` checkpoints of `out_dir` (0 keeps all).
pub fn prune(out_dir: &Path, keep: usize) -> Result<()> {
    if keep == 0 {
        return Ok(());
    }
    let mut all = list(out_dir)?;
    all.sort();
    while all.len() > keep {
        let (_, d) = all.remove(0);
        std::fs::remove_dir_all(&d).with_context(|| format!("cannot remove old checkpoint {}", d.display()))?;
    }
    Ok(())
}

/// (step, dir) of every complete checkpoint in `out_dir`.
pub fn list(out_dir: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut out = Vec::new();
    if !out_dir.exists() {
        return Ok(out);
    }
    for e in std::fs::read_dir(out_dir).with_context(|| format!("cannot list {}", out_dir.display()))? {
        let e = e?;
        let name = e.file_name().to_string_lossy().to_string();
        if let Some(s) = name.strip_prefix("checkpoint-") {
            if let Ok(step) = s.parse::<u64>() {
                if e.path().join(STATE_FILE).exists() {
                    out.push((step, e.path()));
                }
            }
        }
    }
    Ok(out)
}

/// A checkpoint directory, or a run directory (its newest checkpoint).
pub fn resolve(path: &Path) -> Result<PathBuf> {
    if path.join(STATE_FILE).exists() {
        return Ok(path.to_path_buf());
    }
    let mut all = list(path)?;
    all.sort();
    match all.pop() {
        Some((_, d)) => Ok(d),
        None => bail!("{}: not a checkpoint and holds no checkpoint-* directory with {STATE_FILE}", path.display()),
    }
}

/// A checkpoint's trainer state and its FP32 master weights and Adam moments (m, v).
pub type Loaded = (TrainerState, Vec<f32>, Vec<f32>, Vec<f32>);

/// Reads a checkpoint's state and optimizer tensors, checking that it belongs to `job`.
pub fn load(dir: &Path, job: &JobConfig) -> Result<Loaded> {
    let sp = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&sp).with_context(|| format!("cannot read {}", sp.display()))?;
    let state: TrainerState =
        serde_json::from_str(&text).with_context(|| format!("{}: not a valid trainer state", sp.display()))?;
    let fp = fingerprint(job);
    if !belongs(&state.fingerprint, job) {
        bail!(
            "{} belongs to another run (fingerprint {} != {fp} of this config); resume with the config that made it",
            dir.display(),
            state.fingerprint
        );
    }
    let op = dir.join(OPT_FILE);
    let bytes = std::fs::read(&op).with_context(|| format!("cannot read {}", op.display()))?;
    let st = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| anyhow::anyhow!("{}: invalid safetensors file: {e}", op.display()))?;
    let get = |name: &str| -> Result<Vec<f32>> {
        match st.tensor(name) {
            Ok(t) => Ok(t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            Err(_) => Ok(Vec::new()),
        }
    };
    let master = get("master")?;
    if master.len() != state.num_params {
        bail!("{}: master weights hold {} values, the state says {}", op.display(), master.len(), state.num_params);
    }
    Ok((state, master, get("exp_avg")?, get("exp_avg_sq")?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How a run executes is not what it is: the fingerprint ignores `cuda_graphs` and
    /// `kv_release`, and matches what a config without them (an older release's) hashed to.
    #[test]
    fn execution_settings_leave_the_fingerprint_alone() {
        let j = JobConfig::from_toml(include_str!("../../configs/tiny-opd.toml"), "tiny-opd.toml").unwrap();
        let mut k = j.clone();
        (k.rollout.cuda_graphs, k.rollout.kv_release) = (false, crate::config::KvRelease::Never);
        assert_eq!(fingerprint(&j), fingerprint(&k));
        k.optimizer.lr *= 2.0;
        assert_ne!(fingerprint(&j), fingerprint(&k));
        // The TOML of the release before both settings, hashed as it was then.
        let mut n = j.clone();
        (n.run.steps, n.run.device, n.run.devices) = (0, String::new(), 0);
        (n.eval, n.checkpoint) = (Default::default(), Default::default());
        let old = n.to_toml().replace("cuda_graphs = true\n", "").replace("kv_release = \"auto\"\n", "");
        assert!(!old.contains("cuda_graphs") && !old.contains("kv_release"), "{old}");
        assert_eq!(fingerprint(&j), format!("{:016x}", crate::rand::fnv1a64(old.as_bytes())));
        // The previous release hashed cuda_graphs in: its checkpoints belong to the run whatever
        // cuda_graphs is now, another run's do not.
        let full = |j: &JobConfig| {
            let mut n = j.clone();
            (n.run.steps, n.run.device, n.run.devices) = (0, String::new(), 0);
            (n.eval, n.checkpoint) = (Default::default(), Default::default());
            let t = n.to_toml().replace("kv_release = \"auto\"\n", "");
            format!("{:016x}", crate::rand::fnv1a64(t.as_bytes()))
        };
        let mut off = j.clone();
        off.rollout.cuda_graphs = false;
        for old in [full(&j), full(&off)] {
            assert_ne!(old, fingerprint(&j));
            assert!(belongs(&old, &j) && belongs(&old, &off), "{old}");
            assert!(!belongs(&old, &k), "another run's checkpoint: {old}");
        }
    }
}
