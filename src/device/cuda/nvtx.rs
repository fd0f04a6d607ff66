//! NVTX ranges with the names of the tracing spans, so an Nsight Systems timeline reads like the
//! run's report: `step`, each worker's `phase` spans under their phase name (`rollout`,
//! `teacher`, `train`, `resync`, `generate`, …), the orchestrator's `reward` and so on. A
//! `tracing_subscriber` layer: entering a span pushes a range on the current thread, leaving it
//! pops it. Without a tool attached the NVTX calls are no-ops.
//!
//! Owns: the layer. May call: the C shim of csrc/nvtx (linked when build.rs found the NVTX
//! headers, `cfg(colotrain_nvtx)`). Must not: keep state across spans.

use tracing::span::{Attributes, Id};
use tracing::Subscriber;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::registry::LookupSpan;

#[cfg(colotrain_nvtx)]
mod sys {
    use std::ffi::{c_char, CString};
    extern "C" {
        fn ct_nvtx_push(name: *const c_char);
        fn ct_nvtx_pop();
    }
    pub fn push(name: &str) {
        let c = CString::new(name.replace('\0', " ")).unwrap_or_default();
        // SAFETY: `c` is a NUL-terminated string that outlives the call; NVTX copies it.
        unsafe { ct_nvtx_push(c.as_ptr()) }
    }
    pub fn pop() {
        // SAFETY: no arguments; NVTX ignores a pop without a matching push.
        unsafe { ct_nvtx_pop() }
    }
}

#[cfg(not(colotrain_nvtx))]
mod sys {
    pub fn push(_: &str) {}
    pub fn pop() {}
}

/// The range name of a span: its `name` field when it has one (the worker's `phase` spans),
/// else the span's own name with its other fields (`step 12`).
struct RangeName(String);

struct Visit<'a> {
    name: &'a mut Option<String>,
    rest: &'a mut String,
}

impl tracing::field::Visit for Visit<'_> {
    fn record_str(&mut self, f: &tracing::field::Field, v: &str) {
        if f.name() == "name" {
            *self.name = Some(v.to_string());
        } else {
            self.rest.push_str(&format!(" {v}"));
        }
    }
    fn record_debug(&mut self, f: &tracing::field::Field, v: &dyn std::fmt::Debug) {
        if f.name() == "name" {
            *self.name = Some(format!("{v:?}"));
        } else {
            self.rest.push_str(&format!(" {v:?}"));
        }
    }
}

/// Mirrors every span as an NVTX range of the same name.
pub struct NvtxLayer;

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for NvtxLayer {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let (mut name, mut rest) = (None, String::new());
        attrs.record(&mut Visit { name: &mut name, rest: &mut rest });
        let label = match name {
            Some(n) => format!("{n}{rest}"),
            None => format!("{}{rest}", attrs.metadata().name()),
        };
        if let Some(span) = ctx.span(id) {
            span.extensions_mut().insert(RangeName(label));
        }
    }

    fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(n) = span.extensions().get::<RangeName>() {
                sys::push(&n.0);
            }
        }
    }

    fn on_exit(&self, _id: &Id, _ctx: Context<'_, S>) {
        sys::pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tracing_subscriber::layer::SubscriberExt;

    /// Spans carry the range names the timeline will show, and entering/leaving them calls
    /// NVTX without a tool attached (no-ops, no crash).
    #[test]
    fn spans_become_named_ranges() {
        struct Names(std::sync::Arc<std::sync::Mutex<Vec<String>>>);
        impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Names {
            fn on_enter(&self, id: &Id, ctx: Context<'_, S>) {
                if let Some(n) = ctx.span(id).and_then(|s| s.extensions().get::<RangeName>().map(|r| r.0.clone())) {
                    self.0.lock().expect("names").push(n);
                }
            }
        }
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let sub = tracing_subscriber::registry().with(NvtxLayer).with(Names(seen.clone()));
        tracing::subscriber::with_default(sub, || {
            let _s = tracing::info_span!("step", step = 12u64).entered();
            let _p = tracing::info_span!("phase", name = "train", worker = 1usize).entered();
        });
        assert_eq!(*seen.lock().expect("names"), vec!["step 12".to_string(), "train 1".to_string()]);
    }
}
