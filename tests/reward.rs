//! Rewards from the user's side: `colotrain reward` on a small JSONL with the built-in rule and
//! with a plug-in script, its input errors, and the tiny GRPO job rewarded by the built-in rule
//! and by a plug-in implementing the same rule (`colotrain reward --serve`): the same rewards
//! and the same trajectory. The plug-in's faults (crash, hang, garbage, too few lines) are
//! tested next to the client in `src/reward/plugin.rs`.

mod common;

use colotrain::config::JobConfig;
use colotrain::orchestrator::{self as job, JobOptions};
use common::TempDir;
use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_colotrain");

fn lines(p: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn reward_cli(args: &[&str]) -> (bool, String) {
    let o = Command::new(BIN).arg("reward").args(args).output().unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

const PAIRS: &str = r#"{"response": "so \\boxed{\\frac12}", "answer": "\\frac{1}{2}"}
{"response": "I think 7", "answer": "7"}
{"response": "\\boxed{\\sqrt{12}}", "answer": "2\\sqrt3"}
{"response": "\\boxed{x = 5}", "answer": 5}
{"response": "\\boxed{4}", "answer": "4", "truncated": true}
{"response": "\\boxed{3+2x}", "answer": "2x+3", "meta": {"source": "hand"}}
"#;

#[test]
fn the_builtin_rule_on_a_small_jsonl() {
    let t = TempDir::new("reward-builtin");
    let (inp, out) = (t.path().join("pairs.jsonl"), t.path().join("out.jsonl"));
    std::fs::write(&inp, PAIRS).unwrap();
    let (ok, err) = reward_cli(&["--input", inp.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(ok, "{err}");
    let o = lines(&out);
    let rewards: Vec<f64> = o.iter().map(|l| l["reward"].as_f64().unwrap()).collect();
    assert_eq!(rewards, vec![1.0, 0.0, 1.0, 1.0, 0.0, 1.0]);
    assert_eq!(o[0]["extracted"], "\\frac12");
    assert_eq!(o[1]["no_answer"], true);
    assert_eq!(o[3]["normalized"][0], "x=5");
    assert_eq!(o.iter().map(|l| l["line"].as_u64().unwrap()).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5, 6]);
    assert!(err.contains("no boxed answer 1") && err.contains("truncated 1"), "{err}");
}

#[test]
fn a_plugin_script_on_a_small_jsonl() {
    let t = TempDir::new("reward-plugin");
    let script = t.path().join("contains.py");
    // Reward 1 when the reference answer occurs in the response; an extra numeric field.
    std::fs::write(
        &script,
        "import json, sys\nfor line in sys.stdin:\n    x = json.loads(line)\n    r = 1.0 if x.get('answer') and x['answer'] in x['response'] else 0.0\n    print(json.dumps({'reward': r, 'length': len(x['response']), 'has_meta': int('meta' in x)}), flush=True)\n",
    )
    .unwrap();
    let cfg = t.path().join("run.toml");
    std::fs::write(
        &cfg,
        format!("[model]\npath = \"unused\"\n[teacher]\npath = \"unused\"\n[reward]\ncommand = [\"python3\", \"{}\"]\nbatch = 4\n", script.display()),
    )
    .unwrap();
    let (inp, out) = (t.path().join("pairs.jsonl"), t.path().join("out.jsonl"));
    std::fs::write(&inp, PAIRS).unwrap();
    let (ok, err) = reward_cli(&[
        "--input",
        inp.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--config",
        cfg.to_str().unwrap(),
    ]);
    assert!(ok, "{err}");
    let o = lines(&out);
    let rewards: Vec<f64> = o.iter().map(|l| l["reward"].as_f64().unwrap()).collect();
    // "7" is in "I think 7"; a truncated response is 0 without asking the plug-in.
    assert_eq!(rewards, vec![0.0, 1.0, 0.0, 1.0, 0.0, 0.0]);
    assert_eq!(o[1]["extra"]["length"].as_f64(), Some(9.0));
    assert_eq!(o[5]["extra"]["has_meta"].as_f64(), Some(1.0));
    assert!(o[4]["extra"].is_null(), "the truncated response was sent to the plug-in: {}", o[4]);
    assert!(err.contains("the plug-in `python3"), "{err}");
}

#[test]
fn bad_reward_input_names_the_file_and_line() {
    let t = TempDir::new("reward-bad");
    let (inp, out) = (t.path().join("pairs.jsonl"), t.path().join("out.jsonl"));
    let o = out.to_str().unwrap();
    for (text, want) in [
        (
            "{\"response\": \"\\\\boxed{1}\", \"answer\": \"1\"}\n{\"answer\": \"2\"}\n",
            "pairs.jsonl:2: missing field 'response'",
        ),
        ("{\"response\": \"\\\\boxed{1}\"}\n", "pairs.jsonl:1: missing field 'answer'"),
        ("{\"response\": 3, \"answer\": \"1\"}\n", "pairs.jsonl:1: 'response' must be a string"),
        ("{\"response\": \"x\", \"answer\": \"1\", \"truncated\": \"no\"}\n", "'truncated' must be true or false"),
        ("", "no lines"),
    ] {
        std::fs::write(&inp, text).unwrap();
        let (ok, err) = reward_cli(&["--input", inp.to_str().unwrap(), "--out", o]);
        assert!(!ok && err.contains(want), "{want}: {err}");
        assert!(!out.exists(), "an output was written for bad input");
    }
    let cfg = t.path().join("run.toml");
    std::fs::write(&cfg, "[model]\npath = \"unused\"\n[teacher]\npath = \"unused\"\n[reward]\ncommand = [\"/nonexistent/reward-plugin\"]\n").unwrap();
    std::fs::write(&inp, PAIRS).unwrap();
    let (ok, err) = reward_cli(&["--input", inp.to_str().unwrap(), "--out", o, "--config", cfg.to_str().unwrap()]);
    assert!(!ok && err.contains("/nonexistent/reward-plugin"), "{err}");
    std::fs::write(&cfg, "[model]\npath = \"unused\"\n[teacher]\npath = \"unused\"\n[reward]\nbatch = 0\n").unwrap();
    let (ok, err) = reward_cli(&["--input", inp.to_str().unwrap(), "--out", o, "--config", cfg.to_str().unwrap()]);
    assert!(!ok && err.contains("reward.batch"), "{err}");
}

/// The tiny GRPO job rewarded by the built-in rule and by `colotrain reward --serve` (the same
/// rule behind the plug-in protocol, in another process): every step's rewards, losses and
/// samples are the same, and the metrics count the plug-in's scoring.
#[test]
fn a_plugin_with_the_builtin_rule_gives_the_same_run() {
    let t = TempDir::new("reward-job");
    let run = |name: &str, command: Vec<String>| {
        let mut j =
            JobConfig::from_toml(include_str!("../configs/tiny-grpo-triage.toml"), "tiny-grpo-triage.toml").unwrap();
        j.run.out_dir = Some(t.path().join(name));
        (j.run.steps, j.eval.every, j.data.heldout_size) = (3, 0, 8);
        (j.rollout.prompts_per_step, j.rollout.samples_per_prompt) = (4, 4);
        j.learner = Default::default();
        j.reward.command = command;
        j.validate("test").unwrap();
        job::run(&j, &JobOptions::default()).unwrap();
        lines(&t.path().join(name).join("metrics.jsonl"))
    };
    let builtin = run("builtin", Vec::new());
    let plugin = run("plugin", vec![BIN.into(), "reward".into(), "--serve".into()]);
    assert_eq!(builtin.len(), plugin.len());
    for (a, b) in builtin.iter().zip(&plugin).filter(|(a, _)| a["step"].as_u64() > Some(0)) {
        let step = &a["step"];
        for key in ["reward", "loss", "samples_digest", "grad_norm"] {
            assert_eq!(a[key], b[key], "step {step}: {key} differs between the built-in rule and the plug-in");
        }
        let (sa, sb) = (&a["reward_stats"], &b["reward_stats"]);
        assert_eq!(sa["scored"].as_u64(), Some(16), "step {step}: {sa}");
        assert_eq!(sa["scored"], sb["scored"], "step {step}");
        // The plug-in answers the rule's counts as extra fields (means over the responses
        // it saw: the truncated ones are not sent).
        assert!(sb["extra"]["no_answer"].as_f64().is_some(), "step {step}: {sb}");
    }
}
