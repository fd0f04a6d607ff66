//! `colotrain quantize` through the binary: a calibration pass on prompts, `--keep-bf16`, both
//! recipes, `--out-dtype`, and the ModelOpt layout it writes, decoded here with this file's own
//! E2M1 / E4M3 tables (not colotrain's) and compared with the original weights within each
//! format's rounding bound; then bad arguments.

mod common;

use common::TempDir;
use safetensors::{Dtype, SafeTensors};
use std::process::Command;

fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_colotrain")).args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

fn ok(args: &[&str]) -> String {
    let (c, o, e) = cli(args);
    assert_eq!(c, 0, "colotrain {args:?} failed:\n{e}");
    o
}

/// E4M3 (FN: bias 7, no infinities, S.1111.111 is NaN) decoded from the bit fields.
fn e4m3(b: u8) -> f64 {
    let (s, e, m) = ((b >> 7) & 1, ((b >> 3) & 0xF) as i32, (b & 7) as f64);
    let v = if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
    if s == 1 {
        -v
    } else {
        v
    }
}

/// E2M1 magnitudes by code (bit 3 is the sign).
fn e2m1(c: u8) -> f64 {
    let v = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(c & 7) as usize];
    if c & 8 != 0 {
        -v
    } else {
        v
    }
}

fn f32s(st: &SafeTensors, name: &str) -> Vec<f32> {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    match t.dtype() {
        Dtype::F32 => t.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::BF16 => t.data().chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        d => panic!("{name}: unexpected dtype {d:?}"),
    }
}

fn scalar(st: &SafeTensors, name: &str) -> f64 {
    let v = f32s(st, name);
    assert_eq!(v.len(), 1, "{name} is a scalar");
    v[0] as f64
}

#[test]
fn quantize_writes_the_modelopt_layout_that_decodes_to_the_weights() {
    let t = TempDir::new("quantize");
    let m = t.path().join("m");
    let ms = m.to_str().unwrap();
    ok(&[
        "init-tiny",
        "--arch",
        "qwen2",
        "--out",
        ms,
        "--layers",
        "3",
        "--hidden",
        "64",
        "--intermediate",
        "128",
        "--std",
        "0.3",
        "--seed",
        "5",
        "--dtype",
        "f32",
    ]);
    let prompts = t.path().join("p.jsonl");
    std::fs::write(&prompts, "{\"prompt\": \"hello there\"}\n{\"prompt\": \"2+2=\"}\n").unwrap();
    let orig_bytes = std::fs::read(m.join("model.safetensors")).unwrap();
    let orig = SafeTensors::deserialize(&orig_bytes).unwrap();
    for (recipe, algo) in [("nvfp4", "NVFP4"), ("fp8", "FP8")] {
        let out = t.path().join(recipe);
        let o = ok(&[
            "quantize",
            "--model",
            ms,
            "--recipe",
            recipe,
            "--keep-bf16",
            "first-layer",
            "--prompts",
            prompts.to_str().unwrap(),
            "--max-new-tokens",
            "8",
            "--out-dtype",
            "f32",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.contains("2 of 3 layers quantized"), "{o}");
        let hq: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("hf_quant_config.json")).unwrap()).unwrap();
        assert_eq!(hq["quantization"]["quant_algo"], algo);
        assert_eq!(hq["quantization"]["kv_cache_quant_algo"], "FP8");
        let excl: Vec<&str> =
            hq["quantization"]["exclude_modules"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        assert!(
            excl.contains(&"lm_head")
                && excl.contains(&"model.layers.0.mlp.down_proj")
                && !excl.iter().any(|e| e.starts_with("model.layers.1")),
            "{excl:?}"
        );
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        assert_eq!(cfg["quantization_config"]["quant_method"], "modelopt");
        let bytes = std::fs::read(out.join("model.safetensors")).unwrap();
        let st = SafeTensors::deserialize(&bytes).unwrap();
        // The kept first layer: the original weights (f32 as asked), no scales.
        let name0 = "model.layers.0.self_attn.q_proj.weight";
        assert_eq!(f32s(&st, name0), f32s(&orig, name0));
        assert!(st.tensor("model.layers.0.self_attn.q_proj.weight_scale").is_err());
        for l in 1..3 {
            for lin in ["self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"] {
                let p = format!("model.layers.{l}.{lin}");
                let w0 = f32s(&orig, &format!("{p}.weight"));
                let q = st.tensor(&format!("{p}.weight")).unwrap();
                let (n, k) = (
                    orig.tensor(&format!("{p}.weight")).unwrap().shape()[0],
                    w0.len() / orig.tensor(&format!("{p}.weight")).unwrap().shape()[0],
                );
                assert!(scalar(&st, &format!("{p}.input_scale")) > 0.0, "{p}: calibrated input scale");
                if recipe == "nvfp4" {
                    assert_eq!((q.dtype(), q.shape()), (Dtype::U8, &[n, k / 2][..]), "{p}");
                    let s = st.tensor(&format!("{p}.weight_scale")).unwrap();
                    assert_eq!((s.dtype(), s.shape()), (Dtype::F8_E4M3, &[n, k / 16][..]), "{p}");
                    let g = scalar(&st, &format!("{p}.weight_scale_2"));
                    // ModelOpt: global = amax / (6 · 448).
                    let amax = w0.iter().fold(0.0f64, |a, &v| a.max(v.abs() as f64));
                    assert!((g - amax / 2688.0).abs() <= 1e-7 * g, "{p}: weight_scale_2 {g} vs {}", amax / 2688.0);
                    for (b, blk) in w0.chunks(16).enumerate() {
                        let bs = e4m3(s.data()[b]) * g;
                        let bamax = blk.iter().fold(0.0f64, |a, &v| a.max(v.abs() as f64));
                        for (j, &x) in blk.iter().enumerate() {
                            let i = b * 16 + j;
                            let byte = q.data()[i / 2];
                            let code = if i % 2 == 0 { byte & 0xF } else { byte >> 4 };
                            let v = e2m1(code) * bs;
                            // Half an E2M1 step at the block's top (bamax/6 · 6/2 /3 ≈ bamax/6),
                            // with the E4M3 scale's own rounding (≤ 2^-4) on top.
                            assert!((v - x as f64).abs() <= bamax / 6.0 * 1.07 + 1e-9, "{p}[{i}]: {v} vs {x}");
                        }
                    }
                } else {
                    assert_eq!((q.dtype(), q.shape()), (Dtype::F8_E4M3, &[n, k][..]), "{p}");
                    let s = scalar(&st, &format!("{p}.weight_scale"));
                    let amax = w0.iter().fold(0.0f64, |a, &v| a.max(v.abs() as f64));
                    assert!((s - amax / 448.0).abs() <= 1e-7 * s, "{p}: weight_scale");
                    for (i, (&c, &x)) in q.data().iter().zip(&w0).enumerate() {
                        let v = e4m3(c) * s;
                        // E4M3: 3 mantissa bits (relative 2^-4 at RNE), subnormal step 2^-9·s.
                        assert!(
                            (v - x as f64).abs() <= 2f64.powi(-4) * (x as f64).abs() + 2f64.powi(-10) * s + 1e-12,
                            "{p}[{i}]: {v} vs {x}"
                        );
                    }
                }
            }
            assert!(scalar(&st, &format!("model.layers.{l}.self_attn.k_proj.k_scale")) > 0.0);
            assert!(scalar(&st, &format!("model.layers.{l}.self_attn.v_proj.v_scale")) > 0.0);
        }
        // colotrain loads the export back as a quantized engine and generates from it.
        let gen = t.path().join(format!("{recipe}.jsonl"));
        ok(&[
            "generate",
            "--model",
            out.to_str().unwrap(),
            "--prompts",
            prompts.to_str().unwrap(),
            "--max-new-tokens",
            "4",
            "--out",
            gen.to_str().unwrap(),
        ]);
        assert_eq!(std::fs::read_to_string(&gen).unwrap().lines().count(), 2);
    }
}

#[test]
fn quantize_refuses_bad_arguments() {
    let t = TempDir::new("quantize-bad");
    let m = t.path().join("m");
    let ms = m.to_str().unwrap();
    ok(&["init-tiny", "--arch", "llama", "--out", ms, "--layers", "2", "--hidden", "64"]);
    let out = t.path().join("o");
    let os = out.to_str().unwrap();
    let cases: [(&[&str], &str); 3] = [
        (&["quantize", "--model", ms, "--recipe", "fp9", "--out", os], "--recipe: expected fp8 or nvfp4"),
        (&["quantize", "--model", ms, "--recipe", "fp8", "--out", os], "--calibration FILE or --prompts FILE"),
        (
            &[
                "quantize",
                "--model",
                ms,
                "--recipe",
                "fp8",
                "--keep-bf16",
                "first-lyr",
                "--prompts",
                "x.jsonl",
                "--out",
                os,
            ],
            "first-lyr",
        ),
    ];
    for (args, want) in cases {
        let (c, o, e) = cli(args);
        assert_ne!(c, 0, "{args:?}");
        assert!(o.is_empty() && e.contains(want) && !e.contains("panicked"), "{args:?}: {e}");
    }
    // An existing, non-empty output folder is not overwritten.
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(out.join("keep.txt"), "mine").unwrap();
    let cal = t.path().join("p.jsonl");
    std::fs::write(&cal, "{\"prompt\": \"hi\"}\n").unwrap();
    let (c, _, e) = cli(&[
        "quantize",
        "--model",
        ms,
        "--recipe",
        "fp8",
        "--prompts",
        cal.to_str().unwrap(),
        "--max-new-tokens",
        "2",
        "--out",
        os,
    ]);
    assert_ne!(c, 0, "{e}");
    assert_eq!(std::fs::read_to_string(out.join("keep.txt")).unwrap(), "mine");
}
