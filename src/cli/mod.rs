//! The command line: one clap subcommand per job, each implemented in its own file.
//!
//! Owns: argument parsing, logging setup, exit codes. May call every library module. Must not:
//! hold logic that a library user would need (that belongs in the library modules).

mod admit;
mod bench;
mod bench_node;
mod breakdown;
mod device_bench;
mod device_check;
mod eval;
mod generate;
mod init_tiny;
mod inspect;
mod node_ledger;
mod node_model;
mod quantize;
mod report;
mod reward;
mod score;
mod train;

use crate::device::{DType, Device};
use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "colotrain",
    version,
    about = "On-policy post-training of LLMs on one node: decoding, scoring, distillation and RL"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Train: on-policy distillation or SFT (no --config: the built-in tiny OPD job).
    Train(train::Args),
    /// Write a tiny random Hugging Face model directory (config, weights, tokenizer, chat template).
    InitTiny(init_tiny::Args),
    /// Sample responses to prompts with the continuous-batching engine.
    Generate(generate::Args),
    /// Log-probabilities of given token sequences under a model.
    Score(score::Args),
    /// Reward given responses with a run's rule (built-in math rule or `[reward]` plug-in).
    Reward(reward::Args),
    /// Architecture, parameter count, dtypes and memory estimate of a model directory.
    Inspect(inspect::Args),
    /// Held-out KL and accuracy of a checkpoint, Δ against a reference run, budget brackets.
    Eval(eval::Args),
    /// SVG plots of a run's metrics (mismatch, held-out KL, accuracy, reward, entropy, phases);
    /// several runs: where their trainer's step time goes, side by side.
    Report(report::Args),
    /// Offline admission check of candidate rollout engines (seed 000 Eqs. 5-6).
    Admit(admit::Args),
    /// Export a model in the ModelOpt FP8 / NVFP4 layout that vLLM and TensorRT-LLM load.
    Quantize(quantize::Args),
    /// Benchmarks (side by side in one run).
    #[command(subcommand)]
    Bench(bench::Bench),
    /// On a GPU machine: every CUDA op against its CPU twin, then GEMM, decode and resync
    /// timings (bench/device_check.sh runs it).
    DeviceCheck(device_check::Args),
}

/// Options shared by the commands that run a model.
#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArgs {
    /// cpu, cpu:<threads>, cuda or cuda:<ordinal>.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Weight dtype in memory: auto (f32 on CPU, bf16 on CUDA), f32, bf16 or f16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
}

impl DeviceArgs {
    pub fn open(&self) -> Result<(Device, DType)> {
        let dev = Device::parse(&self.device)?;
        let dtype = match self.dtype.as_str() {
            "auto" => {
                if dev.is_cpu() {
                    DType::F32
                } else {
                    DType::BF16
                }
            }
            s => DType::parse(s).map_err(|e| anyhow::anyhow!("--dtype: {e}"))?,
        };
        Ok((dev, dtype))
    }
}

/// Engine sizing options shared by generate and score.
#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    /// Most sequences decoded together.
    #[arg(long, default_value_t = 64)]
    pub max_seqs: usize,
    /// Token budget of one engine step (prefill chunks + decodes).
    #[arg(long, default_value_t = 1024)]
    pub max_tokens_per_step: usize,
    /// KV cache memory in MiB.
    #[arg(long, default_value_t = 512)]
    pub kv_cache_mb: usize,
    /// CPU: keep the linears row-major only, instead of also packing a copy once for decoding
    /// (saves the copy's memory, the size of the linear weights; decodes slower, same outputs).
    #[arg(long)]
    pub no_pack: bool,
    /// CUDA: launch every decode kernel eagerly instead of replaying a CUDA graph per batch size.
    #[arg(long)]
    pub eager: bool,
}

impl EngineArgs {
    pub fn config(&self) -> crate::engine::EngineConfig {
        crate::engine::EngineConfig {
            max_seqs: self.max_seqs,
            max_tokens_per_step: self.max_tokens_per_step,
            kv_cache_bytes: self.kv_cache_mb << 20,
            cuda_graphs: !self.eager,
            ..Default::default()
        }
    }
}

fn init_logging() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let filter = tracing_subscriber::EnvFilter::try_from_env("COLOTRAIN_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_target(false);
    let reg = tracing_subscriber::registry().with(filter).with(fmt);
    // Built with CUDA: every span is also an NVTX range of the same name (Nsight Systems).
    #[cfg(feature = "cuda")]
    let reg = reg.with(crate::device::cuda::nvtx::NvtxLayer);
    let _ = reg.try_init();
}

/// Runs the command line; returns the process exit code.
pub fn main() -> i32 {
    let cli = Cli::parse();
    init_logging();
    match run(cli) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}

pub fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Train(a) => train::run(a),
        Command::InitTiny(a) => init_tiny::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Score(a) => score::run(a),
        Command::Reward(a) => reward::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Bench(b) => bench::run(b),
        Command::Quantize(a) => quantize::run(a),
        Command::Admit(a) => admit::run(a),
        Command::Eval(a) => eval::run(a),
        Command::Report(a) => report::run(a),
        Command::DeviceCheck(a) => device_check::run(a),
    }
}
