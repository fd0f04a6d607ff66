//! `colotrain report RUN_DIR`: SVG plots of a run's metrics log (plotters), so a user looks
//! instead of reads: mismatch (d_n, |δ| quantiles), held-out KL and accuracy, reward, entropy,
//! response length, the per-step phase-time breakdown, and for RL runs ρ_asym, segment tail
//! statistics and TRIAGE's gate/repair counts. Given several runs, it compares where their
//! trainer's step time goes (seed 000 Figure 10, see `breakdown.rs`).

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Run directories (each holds metrics.jsonl). One: every plot of that run. Several: the
    /// step-time breakdown of each, side by side.
    #[arg(required = true, num_args = 1..)]
    pub runs: Vec<PathBuf>,
    /// Output directory for the SVG files (default RUN/report; several runs: the first run's
    /// folder's breakdown/).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Training steps left out of the breakdown's averages as warm-up.
    #[arg(long, default_value_t = 2)]
    pub skip: usize,
}

type Series = (String, Vec<(f64, f64)>);

fn series(metrics: &[Value], name: &str, path: &[&str]) -> Series {
    let pts = metrics
        .iter()
        .filter_map(|m| {
            let step = m.get("step")?.as_f64()?;
            let mut v = m;
            for p in path {
                v = v.get(*p)?;
            }
            v.as_f64().filter(|x| x.is_finite()).map(|y| (step, y))
        })
        .collect();
    (name.to_string(), pts)
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

/// The mismatch guard's events worth a marker: (step, label) of every fall-back and repaired
/// stale view.
fn guard_marks(metrics: &[Value]) -> Vec<(f64, String)> {
    let mut out = Vec::new();
    for m in metrics {
        let (Some(step), Some(events)) =
            (m.get("step").and_then(|s| s.as_f64()), m.pointer("/guard/events").and_then(|e| e.as_array()))
        else {
            continue;
        };
        for e in events {
            match e.get("kind").and_then(|k| k.as_str()) {
                Some("fallback") => {
                    out.push((step, format!("fall-back to {}", e.get("to").and_then(|t| t.as_str()).unwrap_or("?"))))
                }
                Some("stale_view") => out.push((step, "stale view repaired".to_string())),
                _ => {}
            }
        }
    }
    out
}

/// One line chart of several series into `path`, with a dashed vertical marker and its label
/// at each of `marks` (step, label).
fn chart(path: &Path, title: &str, ylabel: &str, all: &[Series], marks: &[(f64, String)]) -> Result<bool> {
    let pts: Vec<&(f64, f64)> = all.iter().flat_map(|s| s.1.iter()).collect();
    if pts.is_empty() {
        return Ok(false);
    }
    let (x0, x1) = pts.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (y0, y1) = pts.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let pad = ((y1 - y0) * 0.05).max(1e-12);
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let mut c = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(x0..x1.max(x0 + 1.0), (y0 - pad)..(y1 + pad))
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    c.configure_mesh().x_desc("step").y_desc(ylabel).draw().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    for (i, (name, s)) in all.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        c.draw_series(LineSeries::new(s.iter().copied(), color.stroke_width(2)))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    for (i, (step, label)) in marks.iter().enumerate() {
        // Dashes: short segments down the plot's height.
        let (lo, hi) = (y0 - pad, y1 + pad);
        let dash = (hi - lo) / 40.0;
        c.draw_series((0..20).map(|k| {
            let a = lo + 2.0 * k as f64 * dash;
            PathElement::new(vec![(*step, a), (*step, (a + dash).min(hi))], BLACK.stroke_width(1))
        }))
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
        let y = hi - (hi - lo) * (0.04 + 0.06 * (i % 4) as f64);
        c.draw_series(std::iter::once(Text::new(format!(" {label}"), (*step, y), ("sans-serif", 12))))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{}: {e:?}", path.display()))?;
    Ok(true)
}

/// Stacked areas of the phase seconds per step.
fn phases(path: &Path, metrics: &[Value]) -> Result<bool> {
    let names = ["rollout", "teacher", "reward", "train", "resync"];
    let rows: Vec<(f64, Vec<f64>)> = metrics
        .iter()
        .filter_map(|m| {
            let t = m.get("time")?;
            Some((
                m.get("step")?.as_f64()?,
                names.iter().map(|n| t.get(*n).and_then(|v| v.as_f64()).unwrap_or(0.0)).collect(),
            ))
        })
        .collect();
    if rows.is_empty() {
        return Ok(false);
    }
    let x1 = rows.iter().map(|r| r.0).fold(1.0, f64::max);
    let y1 = rows.iter().map(|r| r.1.iter().sum::<f64>()).fold(1e-9, f64::max);
    let root = SVGBackend::new(path, (720, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e:?}"))?;
    let mut c = ChartBuilder::on(&root)
        .caption("Where a step's time goes (seconds)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..x1, 0.0..y1 * 1.05)
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    c.configure_mesh().x_desc("step").y_desc("seconds").draw().map_err(|e| anyhow::anyhow!("{e:?}"))?;
    for k in (0..names.len()).rev() {
        let color = COLORS[k % COLORS.len()];
        let pts: Vec<(f64, f64)> = rows.iter().map(|(s, v)| (*s, v[..=k].iter().sum())).collect();
        c.draw_series(AreaSeries::new(pts, 0.0, color.mix(0.6)).border_style(color))
            .map_err(|e| anyhow::anyhow!("{e:?}"))?
            .label(names[k])
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    c.configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| anyhow::anyhow!("{e:?}"))?;
    root.present().map_err(|e| anyhow::anyhow!("{}: {e:?}", path.display()))?;
    Ok(true)
}

fn read_metrics(run: &Path) -> Result<Vec<Value>> {
    let mp = run.join("metrics.jsonl");
    if !mp.exists() {
        bail!("{}: no metrics.jsonl (is it a colotrain run directory?)", run.display());
    }
    let metrics: Vec<Value> = crate::util::read_jsonl(&mp)?.into_iter().map(|(_, v)| v).collect();
    if metrics.is_empty() {
        bail!("{}: no metrics lines", mp.display());
    }
    Ok(metrics)
}

fn run_name(run: &Path) -> String {
    run.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| run.display().to_string())
}

/// Several runs: the breakdown table (stdout, and breakdown.txt) and plot.
fn compare(a: &Args) -> Result<()> {
    let mut rows = Vec::new();
    for r in &a.runs {
        rows.push(super::breakdown::average(&run_name(r), &read_metrics(r)?, a.skip)?);
    }
    let out = a.out.clone().unwrap_or_else(|| a.runs[0].parent().unwrap_or(Path::new(".")).join("breakdown"));
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let t = super::breakdown::table(&rows);
    print!("{t}");
    crate::util::write_atomic(&out.join("breakdown.txt"), t.as_bytes())?;
    super::breakdown::plot(&out.join("breakdown.svg"), &rows)?;
    println!("wrote {} and breakdown.txt", out.join("breakdown.svg").display());
    Ok(())
}

pub fn run(a: Args) -> Result<()> {
    if a.runs.len() > 1 {
        return compare(&a);
    }
    let run = &a.runs[0];
    let metrics = read_metrics(run)?;
    let out = a.out.clone().unwrap_or_else(|| run.join("report"));
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let plots: Vec<(&str, &str, &str, Vec<Series>)> = vec![
        (
            "mismatch.svg",
            "Training-inference mismatch",
            "nats/token",
            vec![
                series(&metrics, "d_n (seed 000 Eq. 2)", &["mismatch", "d_n"]),
                series(&metrics, "mean |δ|", &["mismatch", "abs_mean"]),
                series(&metrics, "k3 KL estimate", &["mismatch", "k3"]),
                // The guard's windowed statistic and its line (runs with [guard]).
                series(&metrics, "guard: statistic (windowed)", &["guard", "windowed"]),
                series(&metrics, "guard: line", &["guard", "line"]),
            ],
        ),
        (
            "delta_quantiles.svg",
            "Token gap δ = log p_θ − log q: lower quantiles",
            "nats",
            vec![series(&metrics, "q0.01", &["mismatch", "q01"]), series(&metrics, "q0.05", &["mismatch", "q05"])],
        ),
        (
            "heldout.svg",
            "Held-out KL to the teacher",
            "nats/token",
            vec![series(&metrics, "held-out KL", &["heldout_kl"])],
        ),
        (
            "accuracy.svg",
            "Held-out accuracy (last boxed answer)",
            "fraction",
            vec![series(&metrics, "accuracy", &["heldout_acc"])],
        ),
        ("reward.svg", "Reward of the step's rollouts", "mean reward", vec![series(&metrics, "reward", &["reward"])]),
        (
            "entropy.svg",
            "Trainer entropy over response tokens",
            "nats",
            vec![series(&metrics, "entropy", &["entropy"])],
        ),
        ("length.svg", "Response length", "tokens", vec![series(&metrics, "mean response length", &["response_len"])]),
        (
            "loss.svg",
            "Loss and gradient norm",
            "",
            vec![series(&metrics, "loss", &["loss"]), series(&metrics, "grad norm", &["grad_norm"])],
        ),
        (
            "rho_asym.svg",
            "Direction asymmetry ρ_asym = w(A⁻)/w(A⁺) (seed 004 Eq. 10)",
            "ratio",
            vec![
                series(&metrics, "|A| weights", &["rl", "rho_asym"]),
                series(&metrics, "|A|/n weights", &["rl", "rho_asym_len_norm"]),
            ],
        ),
        (
            "tail.svg",
            "Segment tail statistics (seed 004 Eqs. 48–50)",
            "share",
            vec![
                series(&metrics, "r_amp", &["rl", "tail", "r_amp"]),
                series(&metrics, "C_tok", &["rl", "tail", "c_tok"]),
                series(&metrics, "H_seg", &["rl", "tail", "h_seg"]),
            ],
        ),
        (
            "triage.svg",
            "TRIAGE: gated tokens and active repair segments per step",
            "count",
            vec![
                series(&metrics, "gated tokens", &["triage", "gated_tokens"]),
                series(&metrics, "repair segments with q > 0", &["triage", "repair_active"]),
            ],
        ),
        (
            "amplification.svg",
            "B_amp / B_con proxies (κ ≡ 1, seed 004 Eq. 7)",
            "",
            vec![
                series(&metrics, "B_amp", &["triage", "b_amp"]),
                series(&metrics, "B_con", &["triage", "b_con"]),
                series(&metrics, "B_amp (base objective)", &["triage", "b_amp_base"]),
            ],
        ),
    ];
    let mut written = Vec::new();
    let marks = guard_marks(&metrics);
    for (file, title, ylabel, s) in &plots {
        let s: Vec<Series> = s.iter().filter(|x| !x.1.is_empty()).cloned().collect();
        let m = if *file == "mismatch.svg" { marks.as_slice() } else { &[] };
        if chart(&out.join(file), title, ylabel, &s, m)? {
            written.push(*file);
        }
    }
    if phases(&out.join("phases.svg"), &metrics)? {
        written.push("phases.svg");
    }
    // The one run's average step (no warm-up skipped when the run is too short for it).
    let skip = if metrics.iter().filter(|m| m.get("time").is_some()).count() > a.skip { a.skip } else { 0 };
    if let Ok(b) = super::breakdown::average(&run_name(run), &metrics, skip) {
        super::breakdown::plot(&out.join("breakdown.svg"), std::slice::from_ref(&b))?;
        written.push("breakdown.svg");
        print!("{}", super::breakdown::table(&[b]));
    }
    println!("wrote {} plots to {}: {}", written.len(), out.display(), written.join(", "));
    Ok(())
}
