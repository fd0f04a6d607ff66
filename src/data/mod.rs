//! Data: prompt files (JSONL), the built-in arithmetic task, answer checking, and the prompt
//! source a training job draws from.
//!
//! Owns: parsing and validation of user-supplied prompt files; deterministic prompt order.
//! May call: `crate::model::TextTools` to render and encode. Must not: run models.

pub mod answer;
pub mod arith;
pub mod dataset;
pub mod math_cmp;
pub mod math_eval;
pub mod math_expr;
pub mod math_lex;
pub mod math_norm;
pub mod prompts;
