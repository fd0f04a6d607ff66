//! A test that needs no GPU: the element-wise kernels of csrc/kernels (quantize.cu, the KV
//! cache write of attention.cu, rope of norm_rope.cu) are compiled for the host with the shim
//! of csrc/hostemu (single thread, `_rn` intrinsics as plain IEEE f32 operations) and their
//! outputs compared bit for bit with the CPU twins: FP8 and NVFP4 quantization (plain, RHT,
//! stochastic rounding, both; from f32 and BF16), dequantization, fake quantization, FP8 / BF16
//! KV writes and RoPE. This checks the kernels' arithmetic and indexing, not the GPU: the
//! device check does that on hardware. Skipped (with a message) when no C++ compiler is found.

use crate::device::{CpuFloats, Device, Tensor};
use crate::ops::quantize::ActQuant;
use crate::quant::fp8::E4M3;
use crate::quant::nvfp4::{self, Nvfp4Opts};
use crate::quant::qtensor::{QFormat, QTensor};
use std::path::{Path, PathBuf};
use std::process::Command;

pub(super) fn read(dir: &Path, name: &str) -> Vec<u8> {
    std::fs::read(dir.join(name)).unwrap_or_else(|e| panic!("host emulation output {name}: {e}"))
}

pub(super) fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Panics naming the first differing element and how many differ (not the whole vectors).
fn same<T: PartialEq + std::fmt::Debug>(got: &[T], want: &[T], what: &str) {
    let bad = got.iter().zip(want).filter(|(a, b)| a != b).count() + got.len().abs_diff(want.len());
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b).or((got.len() != want.len()).then_some(0)) {
        panic!(
            "{what}: {bad} of {} elements differ; first at {i}: kernel {:?}, CPU {:?}",
            want.len(),
            got.get(i),
            want.get(i)
        );
    }
}

/// Compiles csrc/hostemu/`program` with the shim into `out_dir`. None (after a message) when
/// there is no C++ compiler; panics with the compiler's output when the program does not compile.
pub(super) fn compile(program: &str, out_dir: &Path) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let exe = out_dir.join(program.trim_end_matches(".cpp"));
    let emu = root.join("csrc/hostemu");
    let built = Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-ffp-contract=off", "-include"])
        .arg(emu.join("shim.h"))
        .arg(format!("-I{}", emu.join("include").display()))
        .arg(format!("-I{}", root.join("csrc/include").display()))
        .arg(emu.join(program))
        .arg("-o")
        .arg(&exe)
        .output();
    match built {
        Err(e) => {
            eprintln!("skipped: no C++ compiler ({cxx}: {e})");
            None
        }
        Ok(o) if !o.status.success() => {
            panic!("host emulation {program} does not compile:\n{}", String::from_utf8_lossy(&o.stderr))
        }
        Ok(_) => Some(exe),
    }
}

pub(super) fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn kernels_match_the_cpu_twins_under_host_emulation() {
    let dir = std::env::temp_dir().join(format!("colotrain-hostemu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let Some(exe) = compile("main.cpp", &dir) else { return };
    // Inputs: normals at several scales, zeros of both signs, exact multiples of 0.25 (E2M1
    // ties after scaling), tiny values (E4M3 subnormals), outliers.
    let n = 64 * 256;
    let mut s = crate::rand::Stream::new(42, 1);
    let mut x: Vec<f32> = (0..n)
        .map(|i| {
            let z = s.normal() as f32;
            match i % 11 {
                0 => z * 1e-3,
                1 => z * 30.0,
                2 => (i % 97) as f32 * 0.25 * 0.01,
                3 => z * 1e-6,
                _ => z,
            }
        })
        .collect();
    x[5] = 0.0;
    x[6] = -0.0;
    x[17] = 0.75 * 0.0123;
    // An all-zero block and a block whose scale underflows: both get the block scale 1.0.
    x[32..48].fill(0.0);
    for (i, v) in x[48..64].iter_mut().enumerate() {
        *v = (i as f32 - 7.5) * 1e-30;
    }
    let xb: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let signs = nvfp4::rht_signs(77);
    std::fs::write(dir.join("x.bin"), x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).expect("write x");
    std::fs::write(dir.join("signs.bin"), signs.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())
        .expect("write signs");
    let run = Command::new(&exe).arg(&dir).output().expect("run the host emulation");
    assert!(run.status.success(), "host emulation failed: {}", String::from_utf8_lossy(&run.stderr));

    let rows = n / 256;
    for (tag, src) in [("f32", CpuFloats::F32(&x)), ("bf16", CpuFloats::BF16(&xb))] {
        let mut q = QTensor::alloc(QFormat::Fp8, rows, 256, Nvfp4Opts::default()).expect("alloc");
        q.requantize_cpu(src, "x").expect("fp8");
        same(
            &read(&dir, &format!("fp8_codes_{tag}")),
            q.codes_bytes().expect("codes"),
            &format!("FP8 codes from {tag}"),
        );
        assert_eq!(
            f32s(&read(&dir, &format!("fp8_scale_{tag}")))[0].to_bits(),
            q.scale.to_bits(),
            "FP8 scale from {tag}"
        );
        same(
            &bits(&f32s(&read(&dir, &format!("fp8_deq_{tag}")))),
            &bits(&q.dequantize()),
            &format!("FP8 dequant from {tag}"),
        );
        for v in 0..4 {
            let opts = Nvfp4Opts {
                rht: (v & 1 == 1).then_some(77),
                stochastic: (v >> 1 == 1).then_some(0x1234_5678_90ab_cdef),
            };
            let mut q = QTensor::alloc(QFormat::Nvfp4, rows, 256, opts).expect("alloc");
            q.requantize_cpu(src, "x").expect("nvfp4");
            let t = format!("{v}_{tag}");
            same(
                &read(&dir, &format!("nv_packed{t}")),
                q.codes_bytes().expect("codes"),
                &format!("NVFP4 codes {opts:?} from {tag}"),
            );
            same(
                &read(&dir, &format!("nv_scales{t}")),
                q.scales_bytes().expect("scales"),
                &format!("NVFP4 scales {opts:?} from {tag}"),
            );
            assert_eq!(
                f32s(&read(&dir, &format!("nv_global{t}")))[0].to_bits(),
                q.scale.to_bits(),
                "NVFP4 global {opts:?}"
            );
            same(
                &bits(&f32s(&read(&dir, &format!("nv_deq{t}")))),
                &bits(&q.dequantize()),
                &format!("NVFP4 dequant {opts:?}"),
            );
        }
    }
    let cpu = Device::cpu(1).expect("cpu");
    let xt = Tensor::from_f32_host(crate::device::DType::F32, &[rows, 256], &x).expect("x");
    let fake = |act: ActQuant| {
        let mut y = Tensor::cpu_zeros(crate::device::DType::F32, &[rows, 256]);
        crate::ops::quantize::fake_quant_rows(&cpu, &xt, &mut y, rows, &act).expect("fake quant");
        bits(&y.to_f32_vec().expect("read"))
    };
    same(&bits(&f32s(&read(&dir, "fp8_fake"))), &fake(ActQuant::Fp8 { scale: 0.0123 }), "FP8 fake quant");
    for v in 0..4 {
        let opts =
            Nvfp4Opts { rht: (v & 1 == 1).then_some(77), stochastic: (v >> 1 == 1).then_some(0x1234_5678_90ab_cdef) };
        let want = fake(ActQuant::Nvfp4 { global: 0.00321, opts });
        same(&bits(&f32s(&read(&dir, &format!("nv_fake{v}")))), &want, &format!("NVFP4 fake quant {opts:?}"));
    }
    let kv: Vec<u8> = x.iter().map(|v| E4M3.encode(v / 0.07f32)).collect();
    same(&read(&dir, "kv_fp8"), &kv, "FP8 KV cache write");
    let kvb: Vec<u8> = xb.iter().flat_map(|v| v.to_bits().to_le_bytes()).collect();
    same(&read(&dir, "kv_bf16"), &kvb, "BF16 KV cache write");
    let (cs, sn) = (f32s(&read(&dir, "rope_cos")), f32s(&read(&dir, "rope_sin")));
    let hr = n / 64;
    let mut xr = Tensor::from_f32_host(crate::device::DType::F32, &[hr, 64], &x).expect("x");
    let ct = Tensor::from_f32_host(crate::device::DType::F32, &[hr, 32], &cs).expect("cos");
    let st = Tensor::from_f32_host(crate::device::DType::F32, &[hr, 32], &sn).expect("sin");
    crate::ops::rope::rope(&cpu, &mut xr, &ct, &st, hr, 1).expect("rope");
    same(&bits(&f32s(&read(&dir, "rope"))), &bits(&xr.to_f32_vec().expect("read")), "RoPE");
    let _ = std::fs::remove_dir_all(&dir);
}
