//! The device trainer's two rules about what it keeps of its operands (`trainable_device.rs`):
//! which GEMM-only operands are written in BF16 ([`Bf16Operands`], the memory plan's rule
//! too) and what the NVFP4 learner keeps for its backward ([`LearnerKeep`]). May call: the
//! model's config. Must not: allocate or launch anything.

use crate::device::DType;
use crate::model::config::ModelConfig;

/// Which of a layer's GEMM-only operands the device trainer writes in BF16 (on CUDA, by
/// default: `DeviceTrainable::set_bf16_inputs`), so that what it allocates and what the memory
/// plan reserves ([`super::DeviceTrainable::activation_bytes`]) follow one rule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bf16Operands {
    /// The first norm's output (q, k, v's input).
    pub h1: bool,
    /// The second norm's output (gate and up's input).
    pub h2: bool,
    /// SwiGLU's output (down's input).
    pub a: bool,
    /// SwiGLU's gradients dg and du (gate and up's output gradients).
    pub dmlp: bool,
    /// A BF16 LM head: the loss pass rounds each chunk's logits and rows to BF16 for its
    /// gradient GEMMs (scratch the plan counts; the head rounds whatever `set_bf16_inputs` says).
    pub head: bool,
}

impl Bf16Operands {
    /// For weights of `dtype` on CUDA, the NVFP4 learner on `learner` = [gate, up, down] (it
    /// quantizes its inputs from f32): BF16 where every reader is a dense BF16 linear, and for
    /// dg and du without MLP biases (whose gradients sum the f32 values); under the learner on
    /// gate or up the backward may store dg and du in BF16 too (`learner_takes_bf16_dy`), which
    /// the plan does not count on.
    pub fn of(cfg: &ModelConfig, dtype: DType, learner: [bool; 3]) -> Bf16Operands {
        let bf = dtype == DType::BF16;
        let gate_up = learner[0] || learner[1];
        Bf16Operands {
            h1: bf,
            h2: bf && !gate_up,
            a: bf && !learner[2],
            dmlp: bf && !gate_up && !cfg.mlp_bias,
            head: bf,
        }
    }
}

/// What the NVFP4 learner keeps of its rounded operands from the forward to the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LearnerKeep {
    /// No NVFP4 learner.
    Off,
    /// F32 copies rounded and rotated back, multiplied in F32 (`linear_dx` / `linear_dw`): the
    /// CPU, and F32 (or F16) weights (the twin of the CPU's f32 learner).
    Rounded,
    /// The codes only (9/16 byte a value): BF16 weights on CUDA, whose backward multiplies the
    /// codes in BF16 as the forward did (`linear::learner_dx` / `learner_dw`), dy rounded to
    /// BF16 as the model's other linears round it.
    Codes,
}

impl LearnerKeep {
    /// For a learner (`on`) training weights of `dtype`, on a CUDA device or not.
    pub fn of(cuda: bool, dtype: DType, on: bool) -> LearnerKeep {
        match on {
            false => LearnerKeep::Off,
            true if cuda && dtype == DType::BF16 => LearnerKeep::Codes,
            true => LearnerKeep::Rounded,
        }
    }
}
