//! Data: prompt files (JSONL) for generation and scoring.
//!
//! Owns: parsing and validation of user-supplied prompt and token files. May call:
//! `crate::model::TextTools` to render and encode. Must not: run models.

pub mod prompts;
