//! A test that needs no GPU: the element-wise kernels of csrc/kernels (quantize.cu, the KV
//! cache write of attention.cu, rope of rope.cu) are compiled for the host with the shim
//! of csrc/hostemu (single thread, `_rn` intrinsics as plain IEEE f32 operations) and their
//! outputs compared bit for bit with the CPU twins: FP8 and NVFP4 quantization (plain, RHT,
//! stochastic rounding, both; from f32 and BF16), dequantization, fake quantization, FP8 / BF16
//! KV writes, RoPE and its table, embedding, gather_rows, the bias add, the BF16/F16 casts and
//! SwiGLU. This checks the kernels' arithmetic and indexing, not the GPU: the
//! device check does that on hardware. Skipped (with a message) when no C++ compiler is found.

mod blocks;

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
        .args(["-std=c++17", "-O2", "-ffp-contract=off", "-U_FORTIFY_SOURCE", "-include"])
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
    // Row ids into the n / 64 rows of x (one out of range, repeats), and RoPE positions.
    let vocab = (n / 64) as u32;
    let ids: Vec<u32> = vec![0, vocab - 1, 3, vocab + 5, 17, 3, 200, 64];
    let pos: Vec<u32> = vec![0, 1, 7, 1000, 4095, 65535, 131071, 999_999];
    let le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    std::fs::write(dir.join("ids.bin"), le(&ids)).expect("write ids");
    std::fs::write(dir.join("pos.bin"), le(&pos)).expect("write positions");
    // Every 4093rd f32 bit pattern but NaNs (their payloads are the GPU's business), and the
    // F16 rounding boundaries: the largest finite value, the overflow tie, the subnormal ties.
    let mut sweep: Vec<u32> = (0..=u32::MAX).step_by(4093).filter(|b| !f32::from_bits(*b).is_nan()).collect();
    sweep.extend([
        0x477fe000, 0x477fefff, 0x477ff000, 0x33000000, 0x33000001, 0x33400000, 0x387fe000, 0x387ff000, 0x38800000,
    ]);
    sweep.extend(sweep.clone().iter().map(|b| b ^ 0x8000_0000));
    std::fs::write(dir.join("sweep.bin"), le(&sweep)).expect("write sweep");
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
    rows_and_activations(&dir, &x, &xb, &ids, &pos);
    let _ = std::fs::remove_dir_all(&dir);
}

/// ct_embedding, ct_gather_rows, ct_add_bias, ct_cast, ct_swiglu and ct_rope_table against
/// `ops::elementwise`, the bias loop of `ops::linear::linear`, half's conversions and
/// `ops::rope::rope_table`, bit for bit; an out-of-range id sets the error word and a NaN row
/// (the CPU twins refuse it before writing, so they run on the valid ids).
fn rows_and_activations(dir: &Path, x: &[f32], xb: &[half::bf16], ids: &[u32], pos: &[u32]) {
    use crate::device::DType;
    use crate::ops::{elementwise, rope};
    let cpu = Device::cpu(1).expect("cpu");
    let (n, c) = (x.len(), 64);
    let v = n / c;
    let good: Vec<u32> = ids.iter().copied().filter(|&i| (i as usize) < v).collect();
    let bad = ids.iter().position(|&i| i as usize >= v).expect("one id out of range");
    let ids_t = Tensor::from_u32_host(&[good.len()], good.clone()).expect("ids");
    // The kernel's rows for the valid ids, in order, and its row for the bad one.
    let split = |got: &[f32]| -> (Vec<u32>, Vec<f32>) {
        let rows: Vec<&[f32]> = got.chunks_exact(c).collect();
        let valid: Vec<f32> =
            rows.iter().enumerate().filter(|(i, _)| *i != bad).flat_map(|(_, r)| r.iter().copied()).collect();
        (bits(&valid), rows[bad].to_vec())
    };
    for (tag, dt) in [("f32", DType::F32), ("bf16", DType::BF16)] {
        let table = Tensor::from_f32_host(dt, &[v, c], x).expect("table");
        let mut out = Tensor::cpu_zeros(DType::F32, &[good.len(), c]);
        elementwise::embedding(&cpu, &table, &ids_t, &mut out, good.len()).expect("embedding");
        let (valid, bad_row) = split(&f32s(&read(dir, &format!("emb_{tag}"))));
        same(&valid, &bits(&out.to_f32_vec().expect("read")), &format!("embedding, {tag} table"));
        assert!(bad_row.iter().all(|z| z.is_nan()), "embedding {tag}: the out-of-range row is NaN");
        assert_eq!(f32s(&read(dir, &format!("emb_err_{tag}")))[0].to_bits(), 1, "CT_ERR_TOKEN_ID");
    }
    let src = Tensor::from_f32_host(DType::F32, &[v, c], x).expect("src");
    let mut dst = Tensor::cpu_zeros(DType::F32, &[good.len(), c]);
    elementwise::gather_rows(&cpu, &src, &ids_t, &mut dst, good.len()).expect("gather_rows");
    let (valid, bad_row) = split(&f32s(&read(dir, "gather")));
    same(&valid, &bits(&dst.to_f32_vec().expect("read")), "gather_rows");
    assert!(bad_row.iter().all(|z| z.is_nan()));
    assert_eq!(f32s(&read(dir, "gather_err"))[0].to_bits(), 2, "CT_ERR_GATHER_ROW");
    // y += b[col], b = the first 64 values (as f32, then as BF16 widened).
    let want_f32: Vec<f32> = x.iter().enumerate().map(|(i, y)| y + x[i % c]).collect();
    let want_bf16: Vec<f32> = x.iter().enumerate().map(|(i, y)| y + xb[i % c].to_f32()).collect();
    same(&bits(&f32s(&read(dir, "bias_f32"))), &bits(&want_f32), "bias add, f32 bias");
    same(&bits(&f32s(&read(dir, "bias_bf16"))), &bits(&want_bf16), "bias add, BF16 bias");
    let u16s = |b: Vec<u8>| b.chunks_exact(2).map(|p| u16::from_le_bytes([p[0], p[1]])).collect::<Vec<u16>>();
    same(&u16s(read(dir, "cast_bf16")), &xb.iter().map(|b| b.to_bits()).collect::<Vec<_>>(), "cast to BF16");
    same(
        &u16s(read(dir, "cast_f16")),
        &x.iter().map(|f| half::f16::from_f32(*f).to_bits()).collect::<Vec<_>>(),
        "cast to F16",
    );
    let sweep: Vec<f32> =
        read(dir, "sweep.bin").chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    same(
        &u16s(read(dir, "cast_f16_sweep")),
        &sweep.iter().map(|f| half::f16::from_f32(*f).to_bits()).collect::<Vec<_>>(),
        "cast to F16, bit-pattern sweep",
    );
    let up: Vec<f32> = x.iter().rev().copied().collect();
    let (g, u) = (
        Tensor::from_f32_host(DType::F32, &[v, c], x).expect("gate"),
        Tensor::from_f32_host(DType::F32, &[v, c], &up).expect("up"),
    );
    let mut o = Tensor::cpu_zeros(DType::F32, &[v, c]);
    elementwise::swiglu(&cpu, &g, &u, &mut o, v).expect("swiglu");
    same(&bits(&f32s(&read(dir, "swiglu"))), &bits(&o.to_f32_vec().expect("read")), "swiglu");
    let inv: Vec<f32> = (0..32).map(|i| x[200 + i].abs() + 1e-6).collect();
    let (pt, ft) = (
        Tensor::from_u32_host(&[pos.len()], pos.to_vec()).expect("pos"),
        Tensor::from_f32_host(DType::F32, &[32], &inv).expect("inv"),
    );
    let (mut cs, mut sn) =
        (Tensor::cpu_zeros(DType::F32, &[pos.len(), 32]), Tensor::cpu_zeros(DType::F32, &[pos.len(), 32]));
    rope::rope_table(&cpu, &pt, &ft, &mut cs, &mut sn, pos.len()).expect("rope table");
    same(&bits(&f32s(&read(dir, "rt_cos"))), &bits(&cs.to_f32_vec().expect("read")), "RoPE table cos");
    same(&bits(&f32s(&read(dir, "rt_sin"))), &bits(&sn.to_f32_vec().expect("read")), "RoPE table sin");
}
