//! The LM head fused with the loss, for training: per chunk of rows, the logits
//! z = h · Whᵀ / T (at most `chunk × vocab` of them at once), their log-softmax, the per-token
//! statistics (log p of the target, entropy), and the logits gradient
//! −c_t·(target_t − softmax(z_t / T)) / T folded straight into dh and dWh.
//!
//! Owns: the training twin (`grad.rs`). There is no forward-only twin here: decoding's LM head
//! is a plain `linear`, and scoring's log-probs are `logprob`. May call: `super::linear`'s
//! training GEMMs. Must not: materialize more than a chunk of logits.

pub mod grad;
