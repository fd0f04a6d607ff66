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
    /// A rank failed: destroying would wait for it, so the communicator is aborted instead.
    pub aborted: bool,
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
            .map_err(|e| anyhow!("ncclCommInitAll over GPUs {ordinals:?}: {e:?}"))?;
        Ok(comms.into_iter().zip(ordinals).map(|(comm, &ordinal)| RealComm { comm, ordinal, aborted: false }).collect())
    }

    /// Destroys (or, after a failure, aborts) every communicator of a group, in one NCCL group:
    /// destroying one may wait for its peers.
    pub fn release(comms: &[&RealComm]) {
        let aborted = comms.iter().any(|c| c.aborted);
        let grouped = !aborted && nr::group_start().is_ok();
        for c in comms {
            // SAFETY: each handle came from ncclCommInitAll and nothing uses it after this.
            let _ = unsafe {
                if aborted {
                    nr::comm_abort(c.comm)
                } else {
                    nr::comm_destroy(c.comm)
                }
            };
        }
        if grouped {
            let _ = nr::group_end();
        }
    }
}

impl Real {
    /// Queues `parts` on the current stream as one NCCL group call of `c`'s rank.
    pub fn nccl(&self, c: &RealComm, parts: &[Part]) -> Result<()> {
        self.bind()?;
        let stream = self.stream().cu_stream() as ns::cudaStream_t;
        nr::group_start().map_err(|e| anyhow!("ncclGroupStart: {e:?}"))?;
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
                first_err.get_or_insert(format!("{p:?}: {e:?}"));
            }
        }
        // The group is closed whatever happened inside it.
        let end = nr::group_end();
        if let Some(e) = first_err {
            bail!("cuda:{}: NCCL {e}", c.ordinal);
        }
        end.map(|_| ()).map_err(|e| anyhow!("cuda:{}: ncclGroupEnd: {e:?}", c.ordinal))
    }
}
