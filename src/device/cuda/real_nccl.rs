//! NCCL on GPUs (feature `cuda`): the communicators of a group (ncclCommInitAll) and one group
//! call on a device's current stream (ncclGroupStart, ncclReduce / ncclBroadcast per part,
//! ncclGroupEnd). Not run yet: no machine with two GPUs has been lent to this project.
//!
//! Owns: the NCCL handles. May call: cudarc's NCCL bindings. Must not: be reached except
//! through `cuda/nccl.rs`.

use super::super::nccl::Part;
use super::Real;
use anyhow::{anyhow, bail, Result};
use cudarc::nccl::{result as nr, sys as ns};

/// One rank's communicator on GPU `ordinal`.
pub(in crate::device) struct RealComm {
    comm: ns::ncclComm_t,
    pub ordinal: usize,
    /// Aborted (ncclCommAbort, which also frees it): never used again, not destroyed.
    gone: bool,
}

// SAFETY: `comm` is NCCL's communicator handle; NCCL lets a communicator be used from any
// thread as long as calls on it do not overlap, and every use goes through the Mutex that owns
// the RealComm (`CommGroup`). The other fields are plain data.
unsafe impl Send for RealComm {}

impl RealComm {
    /// One communicator per GPU of `ordinals`, rank i on `ordinals[i]` (ncclCommInitAll).
    pub fn init_all(ordinals: &[usize]) -> Result<Vec<RealComm>> {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { ns::is_culib_present() } {
            bail!(
                "NCCL over GPUs {ordinals:?}: libnccl.so could not be loaded (install NCCL or put its folder on \
                 LD_LIBRARY_PATH; the nvidia-nccl wheel ships libnccl.so.2 only: link libnccl.so to it, as \
                 bench/device_check.sh does; COLOTRAIN_DEVICE_COLLECTIVE=peer trains over peer copies instead)"
            );
        }
        let n = ordinals.len();
        let devs: Vec<i32> = ordinals.iter().map(|&o| o as i32).collect();
        let mut comms: Vec<ns::ncclComm_t> = vec![std::ptr::null_mut(); n];
        // SAFETY: `comms` has room for n handles and `devs` holds n device ordinals.
        unsafe { nr::comm_init_all(comms.as_mut_ptr(), n as i32, devs.as_ptr()) }
            .map_err(|e| anyhow!("ncclCommInitAll over GPUs {ordinals:?}: {}", why(&e)))?;
        Ok(comms.into_iter().zip(ordinals).map(|(comm, &ordinal)| RealComm { comm, ordinal, gone: false }).collect())
    }

    pub fn is_gone(&self) -> bool {
        self.gone
    }

    /// Aborts this communicator now: NCCL sets its abort flag, so its kernels queued on the
    /// stream (one waiting for a peer that failed) return, and frees it. Idempotent.
    pub fn abort(&mut self) {
        if !self.gone {
            // SAFETY: the handle came from ncclCommInitAll, the caller holds this rank's lock
            // (no call of this rank is inside NCCL), and `gone` keeps it from being used again.
            let _ = unsafe { nr::comm_abort(self.comm) };
            self.gone = true;
        }
    }

    /// Destroys every communicator of a group that is not gone, in one NCCL group (destroying
    /// one may wait for its peers); after an abort (`aborted`), aborts them instead.
    pub fn release(comms: &mut [&mut RealComm], aborted: bool) {
        if aborted {
            comms.iter_mut().for_each(|c| c.abort());
            return;
        }
        let grouped = nr::group_start().is_ok();
        for c in comms.iter_mut().filter(|c| !c.gone) {
            // SAFETY: each handle came from ncclCommInitAll and `gone` keeps it from being used
            // after this.
            let _ = unsafe { nr::comm_destroy(c.comm) };
            c.gone = true;
        }
        if grouped {
            let _ = nr::group_end();
        }
    }
}

/// An NCCL error as NCCL names it (cudarc's Debug prints only "NcclError").
fn why(e: &nr::NcclError) -> String {
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any result code.
    let text = unsafe {
        let p = ns::ncclGetErrorString(e.0);
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    };
    format!("{:?} ({text})", e.0)
}

impl Real {
    /// Queues `parts` on the current stream as one NCCL group call of `c`'s rank.
    pub fn nccl(&self, c: &RealComm, parts: &[Part]) -> Result<()> {
        if c.gone {
            bail!("cuda:{}: NCCL call on an aborted communicator", c.ordinal);
        }
        self.bind()?;
        let stream = self.stream().cu_stream() as ns::cudaStream_t;
        nr::group_start().map_err(|e| anyhow!("ncclGroupStart: {}", why(&e)))?;
        let mut first_err = None;
        for p in parts {
            // SAFETY: the caller checked each range against a live allocation of this GPU and
            // keeps it alive and unchanged until the stream has run the call; the stream is this
            // device's and its context is current.
            let r = unsafe {
                match *p {
                    Part::Reduce { root, send, recv, count } => nr::reduce(
                        send as *const _,
                        recv as *mut _,
                        count,
                        ns::ncclDataType_t::ncclFloat32,
                        ns::ncclRedOp_t::ncclSum,
                        root as i32,
                        c.comm,
                        stream,
                    ),
                    Part::Broadcast { root, buf, bytes } => nr::broadcast(
                        buf as *const _,
                        buf as *mut _,
                        bytes,
                        ns::ncclDataType_t::ncclUint8,
                        root as i32,
                        c.comm,
                        stream,
                    ),
                }
            };
            if let Err(e) = r {
                first_err.get_or_insert(format!("{p:?}: {}", why(&e)));
            }
        }
        // The group is closed whatever happened inside it.
        let end = nr::group_end();
        if let Some(e) = first_err {
            bail!("cuda:{}: NCCL {e}", c.ordinal);
        }
        end.map(|_| ()).map_err(|e| anyhow!("cuda:{}: ncclGroupEnd: {}", c.ordinal, why(&e)))
    }
}
