//! The simulator's rules, each shown to bite: a deliberately broken launch or memory access
//! fails with the simulator's error, naming the kernel and the rule. (Most of the simulator is
//! exercised by running the real glue on it: the op rooms' `*_sim` tests and tests/sim.rs.)

use super::driver::{Driver, Launch};
use super::kernels::Kernel;
use super::sim::{Sim, SM100A, SM90A};
use super::{ffi, CudaDevice};

fn cast_params(x: u64, y: u64, n: i64) -> ffi::ct_cast_params {
    ffi::ct_cast_params {
        x: x as *mut f32,
        y: y as *mut std::ffi::c_void,
        dtype: ffi::CT_DTYPE_BF16,
        n,
        row_amax: std::ptr::null(),
        cols: 1,
    }
}

fn launch<P>(d: &Driver, k: Kernel, grid: (u32, u32, u32), block: u32, smem: u32, p: &P) -> String {
    let params = p as *const P as *const std::ffi::c_void;
    let ptrs = super::ptr_fields::pointer_offsets(std::any::type_name::<P>());
    let r = d.launch(&Launch { k, grid, block, smem, params, size: std::mem::size_of::<P>(), ptrs });
    r.err().map(|e| format!("{e:#}")).unwrap_or_default()
}

#[test]
fn launches_that_break_the_hardware_rules_are_refused() {
    // A standalone driver: these launches are never run (nothing synchronizes it).
    let d = Driver::Sim(Sim::new(99, SM90A));
    let p = cast_params(0, 0, 0);
    let e = launch(&d, Kernel::Cast, (1, 1, 1), 2048, 0, &p);
    assert!(e.contains("ct_cast") && e.contains("2048 threads per block (the limit is 1024)"), "{e}");
    let e = launch(&d, Kernel::Cast, (1, 70000, 1), 256, 0, &p);
    assert!(e.contains("ct_cast") && e.contains("y and z ≤ 65535"), "{e}");
    // Dynamic shared memory above 48 KiB needs the function attribute first.
    let e = launch(&d, Kernel::PagedAttention, (1, 1, 1), 128, 64 * 1024, &p);
    assert!(e.contains("ct_paged_attention") && e.contains("without the function attribute"), "{e}");
    d.set_max_dynamic_smem(Kernel::PagedAttention, 64 * 1024).unwrap();
    assert_eq!(launch(&d, Kernel::PagedAttention, (1, 1, 1), 128, 64 * 1024, &p), "");
    // ... and never more than the architecture allows (227 KiB on sm_90 and sm_100).
    for arch in [SM90A, SM100A] {
        let d = Driver::Sim(Sim::new(98, arch));
        let e = format!("{:#}", d.set_max_dynamic_smem(Kernel::PrefillAttention, 228 * 1024).unwrap_err());
        assert!(e.contains("ct_prefill_attention") && e.contains(&format!("{} bytes", 227 * 1024)), "{e}");
    }
}

#[test]
fn memory_outside_an_allocation_and_late_frees_are_errors() {
    let d = Driver::Sim(Sim::new(97, SM90A));
    let p = d.malloc(1000).unwrap();
    let e = format!("{:#}", d.memset0(p + 996, 8).unwrap_err());
    assert!(e.contains("runs 4 bytes past the end of its allocation"), "{e}");
    let e = format!("{:#}", d.htod(p + 4096, &[1, 2, 3]).unwrap_err());
    assert!(e.contains("not inside any allocation"), "{e}");
    // A block freed while queued work may still use it: reported at the next synchronize.
    d.memset0(p, 1000).unwrap();
    d.free(p);
    let e = format!("{:#}", d.synchronize().unwrap_err());
    assert!(e.contains("freed while 1 operations were queued"), "{e}");
}

#[test]
fn a_kernel_writing_past_its_buffer_is_caught_at_the_next_synchronize() {
    let dev = CudaDevice::sim_arch(5, Some("sm_90a")).unwrap();
    // 512 bytes is a whole size class of the allocator, so the block ends where the request
    // does (a write past the request but inside its class is not seen, as on a GPU).
    let x = dev.scratch(257 * 4, "x").unwrap();
    let y = dev.scratch(512, "y").unwrap();
    dev.memset0(x.ptr, 257 * 4).unwrap();
    dev.synchronize().unwrap();
    // 257 BF16 values into 256 slots: one element, 2 bytes, past the end.
    dev.k_cast(cast_params(x.ptr, y.ptr, 257)).unwrap();
    let e = format!("{:#}", dev.synchronize().unwrap_err());
    assert!(
        e.contains("cuda-sim:5") && e.contains("a write up to 2 bytes past the end of the allocation of 512 bytes"),
        "{e}"
    );
}

#[test]
fn poisoned_memory_and_the_same_device_for_the_same_ordinal() {
    let a = CudaDevice::sim_arch(4, Some("sm_90a")).unwrap();
    let b = CudaDevice::sim(4).unwrap();
    assert!(std::sync::Arc::ptr_eq(&a.inner, &b.inner), "a second open of cuda-sim:4 must share the first");
    let e = format!("{:#}", CudaDevice::sim_arch(4, Some("sm_100a")).unwrap_err());
    assert!(e.contains("already open as sm_90a"), "{e}");
    // A fresh allocation reads as NaN (0xFF bytes) until written: never as plausible zeros.
    let buf = a.scratch(64, "fresh").unwrap();
    let mut v = [0.0f32; 16];
    a.dtoh(&mut v, buf.ptr).unwrap();
    assert!(v.iter().all(|x| x.is_nan()), "{v:?}");
    assert!(a.name().starts_with("cuda-sim:4") && a.is_sim());
}

#[test]
fn cutlass_kernels_exist_only_for_their_architecture_and_need_tma_alignment() {
    use super::driver::{Cutlass, CutlassArgs};
    let d = Driver::Sim(Sim::new(96, SM90A));
    let (a, b, y) = (d.malloc(64 * 64).unwrap(), d.malloc(64 * 64).unwrap(), d.malloc(64 * 64 * 4).unwrap());
    let args = CutlassArgs { a, b, sfa: 0, sfb: 0, d: y, m: 64, n: 64, k: 64, alpha: 1.0 };
    // No Blackwell image on a Hopper GPU.
    let e = format!("{:#}", d.cutlass(Cutlass::Nvfp4Sm100, &args, 0).unwrap_err());
    assert!(e.contains("ct_nvfp4_gemm_sm100a") && e.contains("no image for this sm_90"), "{e}");
    // TMA needs 16-byte aligned operands: an error (initialize fails), not a quiet refusal.
    let e = format!("{:#}", d.cutlass(Cutlass::Fp8Sm90, &CutlassArgs { a: a + 8, ..args }, 0).unwrap_err());
    assert!(e.contains("operand A") && e.contains("16-byte aligned"), "{e}");
    // can_implement: K % 16 and N % 4 (16-byte strides), else Ok(false) and nothing queued.
    assert!(!d.cutlass(Cutlass::Fp8Sm90, &CutlassArgs { k: 40, ..args }, 0).unwrap());
    assert!(!d.cutlass(Cutlass::Fp8Sm90, &CutlassArgs { n: 62, ..args }, 0).unwrap());
    // An operand smaller than the problem says.
    let e = format!("{:#}", d.cutlass(Cutlass::Fp8Sm90, &CutlassArgs { m: 65, ..args }, 0).unwrap_err());
    assert!(e.contains("CUTLASS operand A") && e.contains("past the end"), "{e}");
    assert!(d.cutlass(Cutlass::Fp8Sm90, &args, 0).unwrap());
    d.memset0(a, 64 * 64).unwrap();
    d.memset0(b, 64 * 64).unwrap();
    d.synchronize().unwrap();
}

#[test]
fn pointer_parameters_must_belong_to_the_device_and_be_aligned() {
    let (d0, d1) = (Driver::Sim(Sim::new(95, SM90A)), Driver::Sim(Sim::new(94, SM90A)));
    let (x, y, idx, err) =
        (d0.malloc(1024).unwrap(), d0.malloc(1024).unwrap(), d0.malloc(4).unwrap(), d0.malloc(4).unwrap());
    d0.htod(idx, &[0u8; 4]).unwrap();
    d0.htod(err, &[0u8; 4]).unwrap();
    let other = d1.malloc(1024).unwrap();
    // ct_gather_rows: f32 rows, u32 indices (every pointer 4-byte elements).
    let gather = |src: u64, idx: u64, dst: u64| ffi::ct_gather_rows_params {
        src: src as *const f32,
        idx: idx as *const u32,
        dst: dst as *mut f32,
        rows: 1,
        cols: 4,
        src_rows: 1,
        err: err as *mut u32,
    };
    assert_eq!(launch(&d0, Kernel::GatherRows, (1, 1, 1), 32, 0, &gather(x, idx, y)), "");
    let e = launch(&d0, Kernel::GatherRows, (1, 1, 1), 32, 0, &gather(x, other, y));
    assert!(e.contains("ct_gather_rows") && e.contains("byte 8") && e.contains("memory of cuda-sim:94"), "{e}");
    // An f32 pointer 2 bytes into a block: a misaligned load on a GPU.
    let e = launch(&d0, Kernel::GatherRows, (1, 1, 1), 32, 0, &gather(x, idx, y + 2));
    assert!(e.contains("ct_gather_rows") && e.contains("byte 16") && e.contains("4-byte elements"), "{e}");
    // A kernel that reads bytes (the FP8 KV cache, NVFP4 scales) takes any offset.
    let p = ffi::ct_swizzle_sf_params {
        src: (x + 3) as *const u8,
        dst: y as *mut u8,
        rows: 1,
        sf_cols: 1,
        padded_rows: 1,
        padded_cols: 1,
    };
    assert_eq!(launch(&d0, Kernel::SwizzleSf, (1, 1, 1), 32, 0, &p), "");
    d0.synchronize().unwrap();
}

#[test]
fn a_read_that_skips_the_synchronization_sees_poison_not_the_data() {
    // The seam offers no unsynchronized read (every dtoh waits for the stream). Work is queued,
    // so memory read behind the stream's back still holds the 0xFF poison: what such a read
    // would see is garbage, as on a GPU, never the data by luck.
    let d = Driver::Sim(Sim::new(93, SM90A));
    let p = d.malloc(16).unwrap();
    d.htod(p, &[7u8; 16]).unwrap();
    // SAFETY: `p` is a live simulated allocation of 16 bytes (host memory); nothing runs
    // concurrently (the queue runs only at a synchronization).
    let early = unsafe { std::slice::from_raw_parts(p as *const u8, 16) }.to_vec();
    assert_eq!(early, vec![0xFF; 16], "the queued copy must not have run yet");
    let mut late = [0u8; 16];
    d.dtoh(&mut late, p).unwrap();
    assert_eq!(late, [7u8; 16], "the seam's read waits for the queued copy");
    d.free(p);
}

/// Only pointer fields are read as addresses: an i32 field whose padding happens to hold the
/// upper half of another device's address (the bytes a struct literal leaves there are
/// arbitrary) is not a pointer into that device's memory; the same address in a pointer field
/// still is.
#[test]
fn an_integer_and_its_padding_are_not_read_as_a_pointer() {
    let (a, b) = (Driver::Sim(Sim::new(96, SM90A)), Driver::Sim(Sim::new(95, SM90A)));
    let (mine, theirs) = (a.malloc(4096).unwrap(), b.malloc(1 << 20).unwrap());
    let target = theirs + 64;
    // ct_gather_rows_params: src, idx, dst (pointers), rows, cols, src_rows (i32), 4 bytes of
    // padding at 36, err (pointer) at 40.
    let mut p = ffi::ct_gather_rows_params {
        src: mine as *const f32,
        idx: mine as *const u32,
        dst: mine as *mut f32,
        rows: 1,
        cols: 1,
        src_rows: (target & 0xffff_ffff) as i32,
        err: mine as *mut u32,
    };
    // SAFETY: bytes 36..40 are the struct's padding (ffi.rs asserts err at 40, src_rows at 32);
    // writing them changes no field.
    unsafe { ((&mut p as *mut _ as *mut u8).add(36) as *mut u32).write_unaligned((target >> 32) as u32) };
    assert_eq!(launch(&a, Kernel::GatherRows, (1, 1, 1), 32, 0, &p), "");
    p.err = target as *mut u32;
    let e = launch(&a, Kernel::GatherRows, (1, 1, 1), 32, 0, &p);
    assert!(e.contains("byte 40") && e.contains("another device"), "{e}");
}

/// A dry device (`sim_dry.rs`) keeps the simulator's rules but backs nothing: 200 GB of
/// allocations cost no host memory, a read returns zeros (the queued copy of 7s never ran),
/// a range past an allocation and a launch past the hardware's limits are still refused, two
/// streams that share a block without an event are still a race, and its addresses lie in
/// the dry range, never inside a backed device's memory.
#[test]
fn a_dry_device_checks_everything_and_backs_nothing() {
    use super::driver::{on_stream, Stream};
    let d = Driver::Sim(Sim::dry(86, SM90A));
    let big: Vec<u64> = (0..4).map(|_| d.malloc(50 << 30).unwrap()).collect();
    assert!(big.iter().all(|&p| p >= 16 << 40 && p % 256 == 0), "{big:x?}");
    let p = d.malloc(16).unwrap();
    d.htod(p, &[7u8; 16]).unwrap();
    let mut back = [1u8; 16];
    d.dtoh(&mut back, p).unwrap();
    assert_eq!(back, [0u8; 16]);
    let e = format!("{:#}", d.memset0(p + 8, 16).unwrap_err());
    assert!(e.contains("runs 8 bytes past the end of its allocation"), "{e}");
    let e = launch(&d, Kernel::Cast, (1, 1, 1), 2048, 0, &cast_params(p, p, 4));
    assert!(e.contains("2048 threads per block"), "{e}");
    assert_eq!(launch(&d, Kernel::Cast, (1, 1, 1), 32, 0, &cast_params(p, big[0], 4)), "");
    on_stream(Stream::Comm, || d.memset0(big[0], 64)).unwrap();
    let e = format!("{:#}", d.synchronize().unwrap_err());
    assert!(e.contains("stream-ordering race"), "{e}");
    let backed = Driver::Sim(Sim::new(85, SM90A));
    let q = backed.malloc(1 << 20).unwrap();
    assert!(!(16 << 40..80 << 40).contains(&q), "a backed block at {q:#x} in the dry range");
    for p in big.into_iter().chain([p]) {
        d.free(p);
    }
    backed.free(q);
    d.synchronize().unwrap();
}

/// A dry GPU's ordinals lie apart from every backed one's (the simulator tells devices apart
/// by ordinal): a backed device refuses a dry device's tensor as an operand and a peer copy
/// from it, either of which would have it read an address with no memory behind it.
#[test]
fn a_dry_gpu_is_never_taken_for_a_backed_one() {
    use crate::device::{DType, Device};
    let dry = CudaDevice::sim_dry(0, Some("sm_90a")).unwrap();
    let backed = CudaDevice::sim_unshared(0);
    assert!(dry.ordinal() >= super::registry::DRY_ORDINALS, "{}", dry.name());
    let t = Device::Cuda(dry.clone()).zeros(DType::F32, &[64]).unwrap();
    let e = format!("{:#}", super::args::ptr(&backed, &t, &[DType::F32], "x").unwrap_err());
    assert!(e.contains("x: tensor on"), "{e}");
    let u = Device::Cuda(backed.clone()).zeros(DType::F32, &[64]).unwrap();
    let (src, dst) = (t.data_ptr() as u64, u.data_ptr() as u64);
    let e = format!("{:#}", backed.peer_copy(dst, &dry, src, 256).unwrap_err());
    assert!(e.contains("devices of different kinds"), "{e}");
    backed.synchronize().unwrap();
}
