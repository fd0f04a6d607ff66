//! Where the trainer's step time goes, one average step per run (seed 000 Figure 10): the
//! trainer's wait for rollouts, teacher scoring, rewards, training and the resync (or, split,
//! the publication of its weights), to scale, beside updates per hour; and the same as a table
//! with generated tokens/s, per-device utilization and the ratio to the first run (Table 8's
//! "ratio to sync. run"). Used by `colotrain report` and bench/schedules.sh.
//!
//! Owns: the averaging over a run's metrics lines and the breakdown plot. May call: plotters.
//! Must not: write anything but the file it is given.

use anyhow::{bail, Result};
use plotters::prelude::*;
use serde_json::Value;
use std::path::Path;

/// The trainer's blocks, in the order of a step.
pub const BLOCKS: [&str; 5] = ["wait for rollouts", "teacher", "reward", "train", "resync"];

/// One run's average step.
#[derive(Clone, Debug, PartialEq)]
pub struct RunBreakdown {
    pub name: String,
    /// Steps averaged over.
    pub steps: usize,
    /// Mean seconds per block (see [`BLOCKS`]), and the mean step.
    pub blocks: [f64; 5],
    pub total: f64,
    pub updates_per_hour: f64,
    /// Response tokens trained on per second of wall time.
    pub tokens_per_s: f64,
    /// Mean busy share per device.
    pub utilization: Vec<f64>,
}

fn num(v: &Value, path: &[&str]) -> Option<f64> {
    let mut v = v;
    for p in path {
        v = v.get(*p)?;
    }
    v.as_f64()
}

/// The average step of `metrics` (a run's metrics.jsonl lines) after the first `skip` training
/// steps (warm-up). The trainer's wait for rollouts is `time.wait − time.teacher`: the rollout
/// phase itself when the step waits for it (synchronous), the wait for the board otherwise.
pub fn average(name: &str, metrics: &[Value], skip: usize) -> Result<RunBreakdown> {
    let steps: Vec<&Value> = metrics.iter().filter(|m| m.get("time").is_some()).skip(skip).collect();
    if steps.is_empty() {
        bail!("{name}: no training steps after the first {skip} (nothing to average)");
    }
    let n = steps.len() as f64;
    let mean = |path: &[&str]| steps.iter().map(|m| num(m, path).unwrap_or(0.0)).sum::<f64>() / n;
    let teacher = mean(&["time", "teacher"]);
    let wait = (mean(&["time", "wait"]) - teacher).max(0.0);
    let blocks = [wait, teacher, mean(&["time", "reward"]), mean(&["time", "train"]), mean(&["time", "resync"])];
    let total = mean(&["time", "total"]);
    let tokens: f64 = steps.iter().map(|m| num(m, &["gen_tokens"]).unwrap_or(0.0)).sum();
    let devices = steps.iter().filter_map(|m| m.get("utilization")?.as_array().map(|a| a.len())).max().unwrap_or(0);
    let utilization = (0..devices)
        .map(|d| {
            steps
                .iter()
                .map(|m| m.get("utilization").and_then(|u| u.get(d)).and_then(|x| x.as_f64()).unwrap_or(0.0))
                .sum::<f64>()
                / n
        })
        .collect();
    Ok(RunBreakdown {
        name: name.to_string(),
        steps: steps.len(),
        blocks,
        total,
        updates_per_hour: 3600.0 / total.max(1e-12),
        tokens_per_s: tokens / (total * n).max(1e-12),
        utilization,
    })
}

/// The table: one row per run.
pub fn table(runs: &[RunBreakdown]) -> String {
    let mut s = format!(
        "{:<28} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>10} {:>7} {:>10}  utilization\n",
        "run",
        "steps",
        "wait s",
        "teacher s",
        "reward s",
        "train s",
        "resync s",
        "step s",
        "updates/h",
        "ratio",
        "tokens/s"
    );
    let base = runs.first().map(|r| r.updates_per_hour).unwrap_or(1.0);
    for r in runs {
        let util: Vec<String> = r.utilization.iter().map(|u| format!("{:.0}%", 100.0 * u)).collect();
        s += &format!(
            "{:<28} {:>6} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>9.4} {:>10.0} {:>7.3} {:>10.0}  {}\n",
            r.name,
            r.steps,
            r.blocks[0],
            r.blocks[1],
            r.blocks[2],
            r.blocks[3],
            r.blocks[4],
            r.total,
            r.updates_per_hour,
            r.updates_per_hour / base.max(1e-12),
            r.tokens_per_s,
            util.join(" ")
        );
    }
    s
}

const COLORS: [RGBColor; 5] = [
    RGBColor(200, 200, 200),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
];

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing the breakdown: {e:?}")
}

/// Writes the Figure-10-style plot: stacked horizontal bars (left) and updates per hour (right).
pub fn plot(path: &Path, runs: &[RunBreakdown]) -> Result<()> {
    if runs.is_empty() {
        bail!("no runs to plot");
    }
    let h = 120 + 44 * runs.len() as u32;
    let root = SVGBackend::new(path, (960, h)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let (left, right) = root.split_horizontally(640);
    let n = runs.len() as f64;
    // Row i (run order, top to bottom) spans y in [n−1−i, n−i): its name above its bar.
    let row = |i: usize| n - 1.0 - i as f64;
    // Room on the right for the legend.
    let xmax = runs.iter().map(|r| r.total.max(r.blocks.iter().sum())).fold(1e-9, f64::max) * 1.4;
    let mut c = ChartBuilder::on(&left)
        .caption("Where the trainer's step goes (one average step per run)", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(32)
        .y_label_area_size(10)
        .build_cartesian_2d(0.0..xmax, 0.0..n)
        .map_err(err)?;
    c.configure_mesh().x_desc("seconds").y_labels(0).disable_y_mesh().draw().map_err(err)?;
    c.draw_series(
        runs.iter().enumerate().map(|(i, r)| {
            Text::new(format!("{}  ({:.3} s)", r.name, r.total), (0.0, row(i) + 0.95), ("sans-serif", 13))
        }),
    )
    .map_err(err)?;
    for (k, name) in BLOCKS.iter().enumerate() {
        let color = COLORS[k];
        let bars = runs.iter().enumerate().map(move |(i, r)| {
            let x0: f64 = r.blocks[..k].iter().sum();
            Rectangle::new([(x0, row(i) + 0.08), (x0 + r.blocks[k], row(i) + 0.55)], color.filled())
        });
        c.draw_series(bars)
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    let umax = runs.iter().map(|r| r.updates_per_hour).fold(1e-9, f64::max) * 1.1;
    let mut u = ChartBuilder::on(&right)
        .caption("updates per hour", ("sans-serif", 16))
        .margin(10)
        .x_label_area_size(32)
        .y_label_area_size(10)
        .build_cartesian_2d(0.0..umax, 0.0..n)
        .map_err(err)?;
    u.configure_mesh()
        .x_labels(4)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_labels(0)
        .disable_y_mesh()
        .draw()
        .map_err(err)?;
    u.draw_series(
        runs.iter().enumerate().map(|(i, r)| {
            Rectangle::new([(0.0, row(i) + 0.08), (r.updates_per_hour, row(i) + 0.55)], COLORS[3].filled())
        }),
    )
    .map_err(err)?;
    let base = runs[0].updates_per_hour.max(1e-12);
    u.draw_series(runs.iter().enumerate().map(|(i, r)| {
        Text::new(
            format!("{:.0}  ×{:.2}", r.updates_per_hour, r.updates_per_hour / base),
            (0.0, row(i) + 0.95),
            ("sans-serif", 13),
        )
    }))
    .map_err(err)?;
    root.present().map_err(|e| anyhow::anyhow!("{}: {e:?}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_average_step_splits_the_trainers_wait_from_teacher_scoring() {
        // Two steps after one warm-up step; wait includes the teacher.
        let m = vec![
            json!({"step": 0, "heldout_kl": 0.5}),
            json!({"step": 1, "time": {"wait": 9.0, "teacher": 1.0, "reward": 0.0, "train": 5.0, "resync": 0.0, "total": 14.0}, "gen_tokens": 100, "utilization": [1.0]}),
            json!({"step": 2, "time": {"wait": 3.0, "teacher": 1.0, "reward": 0.5, "train": 2.0, "resync": 0.5, "total": 6.0}, "gen_tokens": 60, "utilization": [0.5, 1.0]}),
            json!({"step": 3, "time": {"wait": 5.0, "teacher": 2.0, "reward": 0.5, "train": 4.0, "resync": 0.5, "total": 10.0}, "gen_tokens": 100, "utilization": [0.7, 0.0]}),
        ];
        let r = average("r", &m, 1).unwrap();
        assert_eq!(r.steps, 2);
        // wait − teacher: (2 + 3) / 2; teacher (1 + 2) / 2; the rest plain means.
        let want = [2.5, 1.5, 0.5, 3.0, 0.5];
        for (a, b) in r.blocks.iter().zip(want) {
            assert!((a - b).abs() <= 1e-12, "{:?}", r.blocks);
        }
        assert!((r.total - 8.0).abs() <= 1e-12);
        assert!((r.updates_per_hour - 450.0).abs() <= 1e-9);
        // 160 tokens over 16 seconds.
        assert!((r.tokens_per_s - 10.0).abs() <= 1e-9);
        assert_eq!(r.utilization.len(), 2);
        assert!((r.utilization[0] - 0.6).abs() <= 1e-12 && (r.utilization[1] - 0.5).abs() <= 1e-12);
        assert!(average("r", &m, 3).unwrap_err().to_string().contains("no training steps after the first 3"));
        let t = table(&[r.clone(), RunBreakdown { name: "fast".into(), updates_per_hour: 900.0, ..r }]);
        assert!(t.lines().nth(2).unwrap().contains("2.000"), "{t}");
    }
}
