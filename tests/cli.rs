//! End to end through the binary: init-tiny → inspect → generate → score, for every
//! architecture, with text, chat and token prompts, stop strings, and the identity between the
//! engine's sampled log-probs and the scorer's recomputation.

mod common;

use common::TempDir;
use serde_json::Value;
use std::path::Path;
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

fn lines(p: &Path) -> Vec<Value> {
    std::fs::read_to_string(p).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

#[test]
fn tiny_models_of_every_arch_generate_and_score_consistently() {
    let t = TempDir::new("e2e");
    for arch in ["llama", "qwen2", "qwen3"] {
        let dir = t.path().join(arch);
        let d = dir.to_str().unwrap();
        ok(&[
            "init-tiny",
            "--arch",
            arch,
            "--out",
            d,
            "--layers",
            "2",
            "--hidden",
            "64",
            "--std",
            "0.3",
            "--seed",
            "4",
        ]);
        let info = ok(&["inspect", "--model", d]);
        assert!(info.contains("parameters") && info.contains("chat template yes"), "{info}");
        // Refuses to overwrite.
        let (c, _, e) = cli(&["init-tiny", "--arch", arch, "--out", d]);
        assert!(c == 1 && e.contains("already exists and is not empty"), "{e}");

        let prompts = t.path().join(format!("{arch}-p.jsonl"));
        std::fs::write(
            &prompts,
            "{\"prompt\": \"12+30=\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}\n{\"tokens\": [72, 105]}\n",
        )
        .unwrap();
        let out = t.path().join(format!("{arch}-o.jsonl"));
        let (p, o) = (prompts.to_str().unwrap(), out.to_str().unwrap());
        ok(&[
            "generate",
            "--model",
            d,
            "--prompts",
            p,
            "--n",
            "2",
            "--max-new-tokens",
            "12",
            "--seed",
            "7",
            "--out",
            o,
        ]);
        let gen = lines(&out);
        assert_eq!(gen.len(), 6);
        for (i, g) in gen.iter().enumerate() {
            assert_eq!(g["prompt_id"].as_u64().unwrap(), (i / 2) as u64);
            assert_eq!(g["sample"].as_u64().unwrap(), (i % 2) as u64);
            let toks = ids(&g["tokens"]);
            assert_eq!(toks.len(), floats(&g["logprobs"]).len());
            assert!(g["text"].is_string());
            let fr = g["finish_reason"].as_str().unwrap();
            assert!(fr == "length" && toks.len() == 12 || fr == "stop" && toks.len() <= 12, "{g}");
        }

        // Score prompt + response with the same model: identical to the engine's log-probs
        // (temperature 1, no truncation). Prompt 2 is given as tokens, so its ids are known.
        let sc_in = t.path().join(format!("{arch}-s.jsonl"));
        let mut text = String::new();
        for g in &gen[4..6] {
            let mut full = vec![72u64, 105];
            full.extend(ids(&g["tokens"]));
            text.push_str(&serde_json::json!({"tokens": full, "prompt_len": 2}).to_string());
            text.push('\n');
        }
        std::fs::write(&sc_in, text).unwrap();
        let sc_out = t.path().join(format!("{arch}-so.jsonl"));
        ok(&["score", "--model", d, "--input", sc_in.to_str().unwrap(), "--out", sc_out.to_str().unwrap()]);
        let scored = lines(&sc_out);
        for (g, s) in gen[4..6].iter().zip(&scored) {
            let (a, b) = (floats(&g["logprobs"]), floats(&s["logprobs"]));
            assert_eq!(a.len(), b.len());
            for (x, y) in a.iter().zip(&b) {
                assert!((x - y).abs() <= 1e-5, "{arch}: engine {x} vs scorer {y}");
            }
        }
    }
}

#[test]
fn stop_strings_cut_the_text_and_end_the_response() {
    let t = TempDir::new("stop");
    let dir = t.path().join("m");
    let d = dir.to_str().unwrap();
    ok(&["init-tiny", "--out", d, "--layers", "1", "--hidden", "32", "--seed", "1"]);
    let prompts = t.path().join("p.jsonl");
    std::fs::write(&prompts, "{\"tokens\": [65, 66]}\n").unwrap();
    let out = t.path().join("o.jsonl");
    let args = |extra: &[&str]| {
        let mut a = vec![
            "generate",
            "--model",
            d,
            "--prompts",
            prompts.to_str().unwrap(),
            "--max-new-tokens",
            "200",
            "--ignore-eos",
            "--seed",
            "3",
            "--out",
            out.to_str().unwrap(),
        ];
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let a: Vec<String> = args(&[]);
    ok(&a.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    let free = lines(&out).remove(0);
    let toks = ids(&free["tokens"]);
    // Two consecutive printable ASCII tokens (byte-level: token id = byte).
    let i = (1..toks.len())
        .find(|&i| (33..127).contains(&toks[i - 1]) && (33..127).contains(&toks[i]))
        .expect("a printable pair in 200 random bytes");
    let stop = format!("{}{}", toks[i - 1] as u8 as char, toks[i] as u8 as char);
    let first = (1..toks.len()).find(|&j| toks[j - 1] == toks[i - 1] && toks[j] == toks[i]).unwrap();
    let a = args(&["--stop", &stop]);
    ok(&a.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    let cut = lines(&out).remove(0);
    assert_eq!(cut["finish_reason"], "stop");
    assert_eq!(ids(&cut["tokens"]), toks[..=first].to_vec(), "the response ends with the token completing {stop:?}");
    let text = cut["text"].as_str().unwrap();
    assert!(!text.contains(&stop), "{text:?} still holds {stop:?}");
}

/// `colotrain report`: one run gives every plot it has data for plus its breakdown; several runs
/// give the side-by-side breakdown (table on stdout and in breakdown.txt, breakdown.svg); a
/// folder without metrics is a clear error.
#[test]
fn report_plots_one_run_and_compares_several() {
    let t = TempDir::new("report");
    let step = |s: u64, wait: f64, train: f64| {
        serde_json::json!({"step": s, "loss": 0.5 / s as f64, "entropy": 1.0, "mismatch": {"d_n": 1e-4, "abs_mean": 0.01, "k3": 1e-4, "q01": -0.1, "q05": -0.05},
            "time": {"rollout": wait, "teacher": 0.0, "reward": 0.0, "train": train, "resync": 0.0, "wait": wait, "total": wait + train},
            "gen_tokens": 10, "utilization": [1.0]})
    };
    for (name, wait) in [("slow", 3.0), ("fast", 1.0)] {
        let d = t.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        let text: String = (1..=5).map(|s| format!("{}\n", step(s, wait, 1.0))).collect();
        std::fs::write(d.join("metrics.jsonl"), format!("{{\"step\":0,\"heldout_kl\":0.4}}\n{text}")).unwrap();
    }
    let slow = t.path().join("slow");
    let o = ok(&["report", slow.to_str().unwrap()]);
    for f in ["mismatch.svg", "loss.svg", "phases.svg", "breakdown.svg", "heldout.svg"] {
        let svg = std::fs::read_to_string(slow.join("report").join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert!(svg.starts_with("<svg") && svg.len() > 500, "{f}");
    }
    assert!(o.contains("slow") && o.contains("updates/h"), "{o}");
    let out = t.path().join("cmp");
    let o = ok(&[
        "report",
        slow.to_str().unwrap(),
        t.path().join("fast").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    // 4 s vs 2 s per step (steps 3-5): 900 vs 1800 updates/hour, ratio 2.
    let fast = o.lines().find(|l| l.starts_with("fast")).unwrap_or_else(|| panic!("{o}"));
    assert!(fast.contains(" 1800 ") && fast.contains("2.000"), "{fast}");
    assert!(std::fs::read_to_string(out.join("breakdown.txt")).unwrap().contains("slow"));
    assert!(std::fs::read_to_string(out.join("breakdown.svg")).unwrap().contains("fast"));
    let (c, _, e) = cli(&["report", t.path().to_str().unwrap()]);
    assert_ne!(c, 0);
    assert!(e.contains("no metrics.jsonl"), "{e}");
}

/// A new user's Ctrl-C and resume: `train --resume RUN_DIR` with no --config continues with
/// the run's own config.toml (the built-in default's fingerprint differs from a run made with
/// another config), from a checkpoint directory too; the summary printed after the resume
/// starts from the run's first evaluation (step 0), not from the resume; a directory that is
/// no run is a clear error.
#[test]
fn resume_without_config_continues_the_run_with_its_own_config() {
    let t = TempDir::new("resume-cli");
    let run = t.path().join("run");
    let cfg = t.path().join("short.toml");
    let text = include_str!("../configs/tiny-opd.toml")
        .replace("steps = 300", "steps = 4")
        .replace("heldout_size = 128", "heldout_size = 8")
        .replace("prompts_per_step = 8", "prompts_per_step = 2")
        .replace("samples_per_prompt = 8", "samples_per_prompt = 2")
        .replace("[eval]\nevery = 50", "[eval]\nevery = 2")
        .replace("[checkpoint]\nevery = 0", "[checkpoint]\nevery = 2");
    assert!(text.contains("every = 2\nsamples_per_prompt"), "the eval edit applied");
    std::fs::write(&cfg, text).unwrap();
    let r = run.to_str().unwrap();
    ok(&["train", "--config", cfg.to_str().unwrap(), "--out-dir", r, "--steps", "2"]);
    // (The first part ran with --steps 2, which its config.toml records: the run is complete.)
    let o = ok(&["train", "--resume", r]);
    assert!(o.contains("steps          2"), "{o}");
    let o = ok(&["train", "--resume", r, "--steps", "4"]);
    assert!(o.contains("held-out KL") && o.contains("(step 0) ->") && o.contains("(step 4)"), "{o}");
    let m = lines(&run.join("metrics.jsonl"));
    assert_eq!(m.last().unwrap()["step"].as_u64(), Some(4), "the resumed run ran to step 4");
    assert!(m.iter().any(|l| l["step"] == 3 && l.get("loss").is_some()), "step 3 trained after the resume");
    // From a checkpoint directory: its parent's config; --steps still overrides.
    let ck = run.join("checkpoint-000004");
    let o = ok(&["train", "--resume", ck.to_str().unwrap(), "--steps", "6"]);
    assert!(o.contains("(step 0) ->") && o.contains("(step 6)"), "{o}");
    let (c, _, e) = cli(&["train", "--resume", t.path().to_str().unwrap()]);
    assert!(c != 0 && e.contains("no config.toml"), "{e}");
}
