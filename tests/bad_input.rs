//! Bad input gets a clear error naming the file, field or line — never a panic.

mod common;

use colotrain::device::{DType, Device};
use colotrain::model::{LoadedModel, ModelConfig};
use common::*;
use std::path::Path;
use std::process::Command;

fn copy_fixture(name: &str, to: &Path) {
    for e in std::fs::read_dir(fixtures().join("models").join(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn load_err(dir: &Path) -> String {
    let dev = Device::cpu(1).unwrap();
    match LoadedModel::load(dir, &dev, DType::F32) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn config_errors_name_file_and_field() {
    let t = TempDir::new("cfg");
    copy_fixture("qwen3_headdim", t.path());
    let e = load_err(&t.path().join("nope"));
    assert!(e.contains("does not exist"), "{e}");

    std::fs::remove_file(t.path().join("config.json")).unwrap();
    let e = load_err(t.path());
    assert!(e.contains("config.json") && e.contains("cannot read"), "{e}");

    std::fs::write(t.path().join("config.json"), "{\"hidden_size\": 64,").unwrap();
    let e = load_err(t.path());
    assert!(e.contains("config.json: not valid JSON"), "{e}");

    copy_fixture("qwen3_headdim", t.path());
    edit_config(t.path(), |v| v["architectures"] = serde_json::json!(["GPT2LMHeadModel"]));
    let e = load_err(t.path());
    assert!(e.contains("architecture 'GPT2LMHeadModel' is not supported"), "{e}");

    copy_fixture("qwen3_headdim", t.path());
    edit_config(t.path(), |v| {
        v.as_object_mut().unwrap().remove("hidden_size");
    });
    let e = load_err(t.path());
    assert!(e.contains("missing field 'hidden_size'"), "{e}");

    copy_fixture("qwen3_headdim", t.path());
    edit_config(t.path(), |v| v["num_hidden_layers"] = serde_json::json!("three"));
    let e = load_err(t.path());
    assert!(e.contains("'num_hidden_layers' must be a non-negative integer"), "{e}");

    copy_fixture("qwen3_headdim", t.path());
    edit_config(t.path(), |v| v["num_key_value_heads"] = serde_json::json!(3));
    let e = load_err(t.path());
    assert!(e.contains("must be a multiple of num_key_value_heads"), "{e}");

    copy_fixture("qwen3_headdim", t.path());
    edit_config(t.path(), |v| {
        v["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    });
    let e = load_err(t.path());
    assert!(e.contains("rope type 'yarn' is not supported"), "{e}");
}

#[test]
fn both_rope_spellings_parse_to_the_same_config() {
    let new = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
        "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
        "rope_parameters":{"rope_type":"llama3","rope_theta":500000.0,"factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#;
    let old = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
        "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,"rope_theta":500000.0,
        "rope_scaling":{"rope_type":"llama3","factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}}"#;
    let a = ModelConfig::from_json_str(new, "new.json").unwrap();
    let b = ModelConfig::from_json_str(old, "old.json").unwrap();
    assert_eq!(a, b);
    assert_eq!(a.head_dim, 16);
    // Written back (classic spelling) and read again: unchanged.
    let mut c = ModelConfig::from_json_str(&a.to_hf_json("bfloat16").to_string(), "rt.json").unwrap();
    assert_eq!(c.torch_dtype.as_deref(), Some("bfloat16"));
    c.torch_dtype = None;
    assert_eq!(a, c);
}

#[test]
fn weight_errors_name_file_and_tensor() {
    let t = TempDir::new("w");
    copy_fixture("llama_gqa", t.path());
    let st = t.path().join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();

    // Misshapen tensor: claim one fewer layer's worth of MLP width.
    edit_config(t.path(), |v| v["intermediate_size"] = serde_json::json!(150));
    let e = load_err(t.path());
    assert!(
        e.contains("model.safetensors")
            && e.contains("model.layers.0.mlp.gate_proj.weight")
            && e.contains("[160, 96]")
            && e.contains("expected [150, 96]"),
        "{e}"
    );

    // Missing tensor: a config with more layers than the checkpoint.
    copy_fixture("llama_gqa", t.path());
    edit_config(t.path(), |v| v["num_hidden_layers"] = serde_json::json!(3));
    let e = load_err(t.path());
    assert!(e.contains("missing tensor 'model.layers.2.input_layernorm.weight'"), "{e}");

    // A header that claims more bytes than the file holds.
    copy_fixture("llama_gqa", t.path());
    let mut lie = bytes.clone();
    let n = u64::from_le_bytes(lie[..8].try_into().unwrap());
    lie[..8].copy_from_slice(&(n + 1_000_000).to_le_bytes());
    std::fs::write(&st, &lie).unwrap();
    let e = load_err(t.path());
    assert!(e.contains("model.safetensors: invalid safetensors file"), "{e}");

    // Data offsets beyond the end: truncate the payload.
    std::fs::write(&st, &bytes[..bytes.len() - 1000]).unwrap();
    let e = load_err(t.path());
    assert!(e.contains("model.safetensors: invalid safetensors file"), "{e}");

    // No weights at all.
    std::fs::remove_file(&st).unwrap();
    let e = load_err(t.path());
    assert!(e.contains("no model.safetensors or model.safetensors.index.json"), "{e}");

    // A shard index that points at a missing file.
    let q = TempDir::new("shard");
    copy_fixture("qwen2_tied_sharded", q.path());
    std::fs::remove_file(q.path().join("model-00003-of-00004.safetensors")).unwrap();
    let e = load_err(q.path());
    assert!(e.contains("model-00003-of-00004.safetensors"), "{e}");
}

fn cli(args: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_colotrain")).args(args).output().unwrap();
    (out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stderr).to_string())
}

#[test]
fn prompt_file_and_flag_errors_from_the_cli() {
    let t = TempDir::new("cli");
    let model = fixtures().join("models/qwen3_headdim");
    let m = model.to_str().unwrap();
    let p = t.path().join("p.jsonl");
    let ps = p.to_str().unwrap();
    let o = t.path().join("o.jsonl");
    let os = o.to_str().unwrap();
    let run = |extra: &[&str]| {
        let mut a = vec!["generate", "--model", m, "--prompts", ps, "--out", os, "--max-new-tokens", "2"];
        a.extend_from_slice(extra);
        cli(&a)
    };
    std::fs::write(&p, "").unwrap();
    let (c, e) = run(&[]);
    assert_eq!(c, 1);
    assert!(e.contains("p.jsonl: no prompts (the file is empty)"), "{e}");

    std::fs::write(&p, "{\"tokens\": [1, 2]}\n\n{\"tokens\": [1, 2\n").unwrap();
    let (c, e) = run(&[]);
    assert_eq!(c, 1);
    assert!(e.contains("p.jsonl:3: not a valid JSON line"), "{e}");

    std::fs::write(&p, "{\"tokens\": [1, 2]}\n{\"tokens\": [1, 999]}\n").unwrap();
    let (c, e) = run(&[]);
    assert_eq!(c, 1);
    assert!(e.contains("p.jsonl:2: tokens[1] = 999 is out of vocabulary (size 181)"), "{e}");

    std::fs::write(&p, "{\"text\": \"hi\"}\n").unwrap();
    let (c, e) = run(&[]);
    assert!(c == 1 && e.contains("p.jsonl:1: expected one of the fields 'prompt', 'messages' or 'tokens'"), "{e}");

    // A text prompt on a model without tokenizer.json.
    std::fs::write(&p, "{\"prompt\": \"hi\"}\n").unwrap();
    let (c, e) = run(&[]);
    assert!(c == 1 && e.contains("needs the model's tokenizer.json"), "{e}");

    std::fs::write(&p, "{\"tokens\": [1, 2]}\n").unwrap();
    let (c, e) = run(&["--n", "0"]);
    assert!(c == 1 && e.contains("--n must be at least 1"), "{e}");
    for bad in ["--top-p=0", "--top-p=1.5", "--top-p=-0.1"] {
        let (c, e) = run(&[bad]);
        assert!(c == 1 && e.contains("--top-p must be in (0, 1]"), "{bad}: {e}");
    }
    let (c, e) = run(&["--device", "tpu"]);
    assert!(c == 1 && e.contains("device 'tpu'"), "{e}");
    assert!(!o.exists(), "no output file is written on errors");

    // score: bad lines.
    std::fs::write(&p, "{\"tokens\": [5]}\n").unwrap();
    let (c, e) = cli(&["score", "--model", m, "--input", ps, "--out", os]);
    assert!(c == 1 && e.contains("p.jsonl:1: need at least 2 tokens"), "{e}");
    std::fs::write(&p, "{\"tokens\": [5, 6, 7], \"prompt_len\": 4}\n").unwrap();
    let (c, e) = cli(&["score", "--model", m, "--input", ps, "--out", os]);
    assert!(c == 1 && e.contains("prompt_len 4 must be in 1..=3"), "{e}");
}

#[test]
fn cuda_request_without_cuda_is_a_clear_error() {
    let r = Device::parse("cuda:0");
    let e = format!("{:#}", r.unwrap_err());
    if cfg!(feature = "cuda") {
        assert!(!e.is_empty());
    } else {
        assert!(e.contains("built without CUDA support"), "{e}");
    }
}
