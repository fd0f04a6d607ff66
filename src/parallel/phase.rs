//! The phase the calling thread works in: each worker command runs under its phase's name
//! (`rollout`, `teacher`, `train`, ...), and what the thread does meanwhile is attributed to it
//! (the CUDA launch ledger, `device::cuda::ledger`, keys every launch by it). A thread-local
//! scope, set by [`enter_phase`] and restored when its guard drops.
//!
//! Owns: the thread's phase and the interned names. May call: std. Must not: know what is
//! attributed to a phase.

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::Mutex;

/// Phase names as `&'static str` (a run has a handful: rollout, teacher, train, ...), so a
/// reader keys by them without allocating (the ledger, at every launch). At most [`MAX_PHASES`] are kept; later names count as
/// [`OTHER_PHASE`] (the workers' phases are literals, so this bounds a mistake, not a run).
static NAMES: Mutex<Option<HashSet<&'static str>>> = Mutex::new(None);
const MAX_PHASES: usize = 256;
pub const OTHER_PHASE: &str = "(other)";

fn intern(name: &str) -> &'static str {
    let mut g = NAMES.lock().unwrap_or_else(|e| e.into_inner());
    let set = g.get_or_insert_with(HashSet::new);
    if let Some(s) = set.get(name) {
        return s;
    }
    if set.len() >= MAX_PHASES {
        return OTHER_PHASE;
    }
    let s: &'static str = Box::leak(name.to_string().into_boxed_str());
    set.insert(s);
    s
}

/// The phase of launches made outside any [`enter_phase`] scope.
pub const NO_PHASE: &str = "(none)";

thread_local! {
    static PHASE: Cell<&'static str> = const { Cell::new(NO_PHASE) };
}

/// The calling thread's phase.
pub fn current_phase() -> &'static str {
    PHASE.with(|p| p.get())
}

/// Restores the previous phase when dropped.
pub struct PhaseGuard(&'static str);

impl Drop for PhaseGuard {
    fn drop(&mut self) {
        PHASE.with(|p| p.set(self.0));
    }
}

/// Makes `name` the calling thread's phase until the guard is dropped.
pub fn enter_phase(name: &str) -> PhaseGuard {
    let s = intern(name);
    PhaseGuard(PHASE.with(|p| p.replace(s)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A phase scope names the thread's launches and restores the previous name when it ends.
    #[test]
    fn phase_scopes_nest_and_restore() {
        assert_eq!(current_phase(), NO_PHASE);
        {
            let _a = enter_phase("train");
            assert_eq!(current_phase(), "train");
            {
                let _b = enter_phase("resync");
                assert_eq!(current_phase(), "resync");
            }
            assert_eq!(current_phase(), "train");
            // The same name is interned once: the launches of a phase share one key.
            assert!(std::ptr::eq(intern("train"), current_phase()));
        }
        assert_eq!(current_phase(), NO_PHASE);
    }
}
