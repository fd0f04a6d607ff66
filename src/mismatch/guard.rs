//! The mismatch guard: watches a per-step mismatch statistic (seed 000's d_n, Eq. 2, or mean
//! |δ|, or the lower tail quantile of δ, seed 004 §3) against a line — a number, the admission
//! line L/α of seed 000 Eq. 6, or the lower end of an empirical budget bracket B_emp (Eq. 4) —
//! over a window (an EMA or the mean of the last m steps), with a jump rule (the step's value
//! above j × its running median). A breach asks the caller for a consistency check of the
//! engine's view; a stale view is repaired and its step forgotten, a consistent one counts
//! toward a recipe breach, and `patience` recipe breaches in a row move the run down the
//! fall-back ladder.
//!
//! Owns: [`GuardConfig`] (`[guard]`), [`Guard`] (the decisions) and [`GuardState`] (what a
//! checkpoint keeps). May call: `crate::mismatch` (the statistics). Must not: touch engines or
//! devices (the orchestrator checks, repairs and switches; this file only decides).

use super::StepMismatch;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// `[guard]`.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct GuardConfig {
    pub enabled: bool,
    /// The fall-back ladder, least safe first: recipes as `colotrain admit` spells them
    /// (`nvfp4`, `fp8+first-layer`, `fp8-kv`, `bf16`, `noise=0.5`). The run starts on the rung
    /// that is `[engine]`'s recipe (before the first rung when none is).
    pub fallback: Vec<String>,
    /// `d_n` (seed 000 Eq. 2), `abs_mean` (mean |δ|) or `q01` (−(1% quantile of δ): the tail
    /// where the learner finds the sampled token far less likely).
    pub statistic: String,
    /// A number (nats/token), `admit` (L/α: seed 000 Eq. 6's line with its margin) or
    /// `bracket` (the lower end of `bracket`, from `colotrain eval --budget`).
    pub line: Line,
    /// α and L of `line = "admit"`.
    pub alpha: f64,
    pub admit_line: f64,
    /// B_emp = [lo, hi] of `line = "bracket"`.
    pub bracket: Option<[f64; 2]>,
    /// `{ ema = a }` (weight of the newest step) or `{ last = m }` (mean of the last m steps).
    pub window: Window,
    /// Jump rule: the step's value above `jump` × the median of the last 32 values that did not
    /// breach (and above `jump_floor`) is a breach; 0 disables it.
    pub jump: f64,
    pub jump_floor: f64,
    /// Recipe breaches in a row (each with a consistent view) before falling back.
    pub patience: u32,
    /// Steps after the start or a switch before the jump rule arms (its median needs
    /// history; the line applies from the first step).
    pub warmup_steps: u32,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(untagged)]
pub enum Line {
    Value(f64),
    Named(String),
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq)]
#[serde(rename_all = "lowercase", deny_unknown_fields)]
pub enum Window {
    Ema(f64),
    Last(usize),
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            enabled: false,
            fallback: Vec::new(),
            statistic: "d_n".into(),
            line: Line::Named("admit".into()),
            alpha: 1.5,
            admit_line: 0.184,
            bracket: None,
            window: Window::Ema(0.3),
            jump: 8.0,
            jump_floor: 0.02,
            patience: 2,
            warmup_steps: 5,
        }
    }
}

/// The ladder's rungs as engine specs, each with what `[engine]` (`base`) sets beyond the
/// recipe's name: its NVFP4 options (RHT, stochastic rounding), its KV scale (unless the rung
/// names one with `@`), its noise seed and staleness. A noise rung must be `[engine]` itself:
/// a noise engine's s_w is each matrix's std when it is built, which a resumed run could not
/// rebuild for a switch made mid-run. Errors name the rung's key.
pub fn ladder(
    cfg: &GuardConfig,
    num_layers: usize,
    base: &crate::engine::rollout_weights::EngineSpec,
) -> Result<Vec<crate::engine::rollout_weights::EngineSpec>> {
    cfg.fallback
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let c = super::admit::parse_candidate(r, num_layers, base.noise_seed)
                .map_err(|e| anyhow::anyhow!("guard.fallback[{i}]: '{r}': {e:#}"))?;
            let mut spec = crate::engine::rollout_weights::EngineSpec { staleness: base.staleness, ..c.spec };
            spec.recipe.nvfp4 = base.recipe.nvfp4;
            if !r.contains('@') {
                spec.recipe.kv_scale = base.recipe.kv_scale;
            }
            if spec.noise_sigma > 0.0 && spec != *base {
                bail!(
                    "guard.fallback[{i}]: '{r}': a noise rung can only be the recipe the run starts on ([engine] noise_sigma = {r_sigma}): its s_w is measured when the engine is built",
                    r_sigma = spec.noise_sigma
                );
            }
            Ok(spec)
        })
        .collect()
}

/// Values the jump rule's running median is taken over.
const HISTORY: usize = 32;

impl GuardConfig {
    pub fn is_default(&self) -> bool {
        *self == GuardConfig::default()
    }

    /// Checks everything but the rungs' recipes (`parse_rung` checks those against the model);
    /// errors name the key.
    pub fn validate(&self) -> Result<()> {
        if !self.enabled {
            return Ok(());
        }
        if self.fallback.is_empty() {
            bail!("guard.fallback: the ladder is empty; list at least one recipe to fall back to (e.g. [\"fp8\", \"bf16\"])");
        }
        if !matches!(self.statistic.as_str(), "d_n" | "abs_mean" | "q01") {
            bail!("guard.statistic: unknown statistic '{}': expected d_n, abs_mean or q01", self.statistic);
        }
        if !(self.alpha >= 1.0 && self.alpha.is_finite()) {
            bail!("guard.alpha: the margin α must be a finite number >= 1, got {}", self.alpha);
        }
        self.line_value()?;
        match self.window {
            Window::Ema(a) if !(a > 0.0 && a <= 1.0) => {
                bail!("guard.window: ema = {a}: the newest step's weight must be in (0, 1]")
            }
            Window::Last(0) => bail!("guard.window: last = 0: the window needs at least 1 step"),
            _ => {}
        }
        if !(self.jump == 0.0 || (self.jump > 1.0 && self.jump.is_finite())) {
            bail!("guard.jump: must be 0 (off) or a finite factor > 1, got {}", self.jump);
        }
        if !(self.jump_floor >= 0.0 && self.jump_floor.is_finite()) {
            bail!("guard.jump_floor: must be a finite number >= 0, got {}", self.jump_floor);
        }
        if self.patience == 0 {
            bail!("guard.patience: must be at least 1");
        }
        Ok(())
    }

    /// The line in nats/token.
    pub fn line_value(&self) -> Result<f64> {
        let v = match &self.line {
            Line::Value(v) => *v,
            Line::Named(n) if n == "admit" => {
                if !(self.admit_line > 0.0 && self.admit_line.is_finite()) {
                    bail!("guard.admit_line: L must be a positive finite number, got {}", self.admit_line);
                }
                self.admit_line / self.alpha
            }
            Line::Named(n) if n == "bracket" => match self.bracket {
                Some([lo, hi]) if lo > 0.0 && lo <= hi && hi.is_finite() => lo,
                Some(b) => bail!("guard.bracket: expected [lo, hi] with 0 < lo <= hi, got {b:?}"),
                None => bail!(
                    "guard.line = \"bracket\" needs guard.bracket = [lo, hi] (B_emp from colotrain eval --budget)"
                ),
            },
            Line::Named(n) => bail!("guard.line: expected a number, \"admit\" or \"bracket\", got '{n}'"),
        };
        if !(v > 0.0 && v.is_finite()) {
            bail!("guard.line: must be a positive finite number of nats/token, got {v}");
        }
        Ok(v)
    }

    /// The watched statistic of a step.
    pub fn value_of(&self, m: &StepMismatch) -> f64 {
        match self.statistic.as_str() {
            "abs_mean" => m.abs_mean,
            "q01" => -m.q01,
            _ => m.d_n,
        }
    }
}

/// What the guard keeps across steps (and a checkpoint keeps across a resume). f64 values are
/// stored as bit patterns, so that a resumed run decides exactly as the uninterrupted one.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GuardState {
    /// Index into the ladder of the recipe serving now; None: `[engine]`'s own recipe, which is
    /// not on the ladder.
    pub rung: Option<usize>,
    pub ema_bits: Option<u64>,
    /// The window's values (last m) and the jump rule's history, newest last (f64 bits).
    pub window_bits: VecDeque<u64>,
    pub history_bits: VecDeque<u64>,
    /// Consecutive recipe breaches.
    pub breaches: u32,
    /// Steps observed since the start or the last switch.
    pub observed: u64,
    pub fallbacks: u64,
    pub repairs: u64,
}

/// Why a step breached.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Breach {
    /// The windowed statistic is above the line.
    Line,
    /// The step's value jumped above j × its running median.
    Jump,
}

/// One thing the guard saw or did at a step (the metrics line's `guard.events`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Event {
    /// The statistic breached; `consistent`: what the consistency check found.
    Breach { by: Breach, value: f64, windowed: f64, line: f64, consistent: bool },
    /// The engine's view differed from the trainer's weights (a version behind, or these
    /// tensors); repaired by a resync.
    StaleView { engine_version: u64, trainer_version: u64, tensors: Vec<String>, repaired: bool },
    /// The engine moved down the ladder.
    Fallback { from: String, to: String },
    /// A rung was passed over (its plan does not fit, say).
    SkipRung { rung: String, why: String },
    /// A breach on the last rung: nothing left to fall back to.
    LastRung { rung: String },
}

/// The metrics line's `guard` object.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GuardMetrics {
    /// The recipe serving now, in the ladder's spelling.
    pub state: String,
    pub value: f64,
    pub windowed: f64,
    pub line: f64,
    pub events: Vec<Event>,
}

/// The guard's verdict on one step's statistic, before any check.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observation {
    pub value: f64,
    pub windowed: f64,
    pub breach: Option<Breach>,
}

pub struct Guard {
    pub cfg: GuardConfig,
    line: f64,
    /// The name of `[engine]`'s recipe when it is not on the ladder.
    start_name: String,
    pub state: GuardState,
    /// The step's value before it is committed (a stale view's step is dropped instead).
    pending: Option<f64>,
}

fn median(v: &VecDeque<u64>) -> f64 {
    let mut x: Vec<f64> = v.iter().map(|b| f64::from_bits(*b)).collect();
    x.sort_by(|a, b| a.total_cmp(b));
    super::quantile(&x, 0.5)
}

impl Guard {
    /// A guard starting on rung `rung` of the ladder (None: on `start_name`, not on it).
    pub fn new(cfg: &GuardConfig, rung: Option<usize>, start_name: &str) -> Result<Guard> {
        cfg.validate()?;
        Ok(Guard {
            cfg: cfg.clone(),
            line: cfg.line_value()?,
            start_name: start_name.to_string(),
            state: GuardState { rung, ..Default::default() },
            pending: None,
        })
    }

    pub fn line(&self) -> f64 {
        self.line
    }

    /// The recipe serving now.
    pub fn serving(&self) -> String {
        match self.state.rung {
            Some(i) => self.cfg.fallback[i].clone(),
            None => self.start_name.clone(),
        }
    }

    /// The next rung down the ladder, if any.
    pub fn next_rung(&self) -> Option<usize> {
        let next = self.state.rung.map(|i| i + 1).unwrap_or(0);
        (next < self.cfg.fallback.len()).then_some(next)
    }

    /// Puts a checkpoint's state back: a resumed run decides as the uninterrupted one would.
    pub fn restore(&mut self, s: GuardState) {
        self.state = s;
    }

    fn windowed_with(&self, x: f64) -> f64 {
        match self.cfg.window {
            Window::Ema(a) => match self.state.ema_bits {
                Some(e) => a * x + (1.0 - a) * f64::from_bits(e),
                None => x,
            },
            Window::Last(m) => {
                let tail = self.state.window_bits.iter().rev().take(m - 1).map(|b| f64::from_bits(*b));
                let (s, n) = tail.fold((x, 1usize), |(s, n), v| (s + v, n + 1));
                s / n as f64
            }
        }
    }

    /// The step's statistic against the line and the jump rule. Nothing is committed until
    /// [`Self::commit`] (a stale view's step is dropped with [`Self::drop_step`]). A non-finite
    /// value (a step whose log-probs overflowed) is neither a breach nor history.
    pub fn observe(&mut self, m: &StepMismatch) -> Observation {
        let x = self.cfg.value_of(m);
        if !x.is_finite() || m.tokens == 0 {
            self.pending = None;
            let w = match self.cfg.window {
                Window::Ema(_) => self.state.ema_bits.map(f64::from_bits).unwrap_or(f64::NAN),
                Window::Last(_) if self.state.window_bits.is_empty() => f64::NAN,
                Window::Last(_) => {
                    self.state.window_bits.iter().map(|b| f64::from_bits(*b)).sum::<f64>()
                        / self.state.window_bits.len() as f64
                }
            };
            return Observation { value: x, windowed: w, breach: None };
        }
        self.pending = Some(x);
        let windowed = self.windowed_with(x);
        let armed = self.cfg.jump > 0.0
            && self.state.observed >= self.cfg.warmup_steps as u64
            && self.state.history_bits.len() >= 3;
        let breach = if windowed > self.line {
            Some(Breach::Line)
        } else if armed && x > self.cfg.jump_floor && x > self.cfg.jump * median(&self.state.history_bits) {
            Some(Breach::Jump)
        } else {
            None
        };
        Observation { value: x, windowed, breach }
    }

    /// Keeps the observed step in the window and history; `recipe_breach`: it breached with a
    /// consistent view. Returns the rung to fall back to once `patience` breaches in a row
    /// have been seen (None: keep serving, or no rung is left).
    pub fn commit(&mut self, recipe_breach: bool) -> Option<usize> {
        // A step with nothing to judge (non-finite, no tokens) leaves the streak as it is.
        if self.pending.is_none() && !recipe_breach {
            return None;
        }
        if let Some(x) = self.pending.take() {
            let w = self.windowed_with(x);
            if let Window::Ema(_) = self.cfg.window {
                self.state.ema_bits = Some(w.to_bits());
            }
            self.state.window_bits.push_back(x.to_bits());
            if let Window::Last(m) = self.cfg.window {
                while self.state.window_bits.len() > m {
                    self.state.window_bits.pop_front();
                }
            } else {
                self.state.window_bits.clear();
            }
            // A breaching value stays out of the median it is judged against.
            if !recipe_breach {
                self.state.history_bits.push_back(x.to_bits());
                while self.state.history_bits.len() > HISTORY {
                    self.state.history_bits.pop_front();
                }
            }
            self.state.observed += 1;
        }
        if !recipe_breach {
            self.state.breaches = 0;
            return None;
        }
        self.state.breaches += 1;
        if self.state.breaches >= self.cfg.patience {
            self.next_rung()
        } else {
            None
        }
    }

    /// Forgets the observed step (its engine served the wrong weights: the value says nothing
    /// about the recipe).
    pub fn drop_step(&mut self) {
        self.pending = None;
    }

    /// Counts a repaired view.
    pub fn repaired(&mut self) {
        self.state.repairs += 1;
    }

    /// The engine now serves rung `to`: the statistics start over (the new recipe has its own
    /// level), the jump rule warms up again.
    pub fn switched(&mut self, to: usize) {
        self.state = GuardState {
            rung: Some(to),
            fallbacks: self.state.fallbacks + 1,
            repairs: self.state.repairs,
            ..Default::default()
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(d: f64) -> StepMismatch {
        StepMismatch { d_n: d, abs_mean: d.abs(), q01: -2.0 * d, tokens: 10, ..Default::default() }
    }

    fn cfg(edit: impl FnOnce(&mut GuardConfig)) -> GuardConfig {
        let mut c = GuardConfig {
            enabled: true,
            fallback: vec!["nvfp4".into(), "fp8".into(), "bf16".into()],
            line: Line::Value(0.1),
            ..Default::default()
        };
        edit(&mut c);
        c
    }

    #[test]
    fn ema_window_crosses_the_line_and_falls_back_after_patience() {
        let c = cfg(|c| c.window = Window::Ema(0.5));
        let mut g = Guard::new(&c, Some(0), "nvfp4").unwrap();
        // EMA: 0.04 → 0.5·0.16 + 0.5·0.04 = 0.10 (not above) → 0.5·0.2 + 0.5·0.1 = 0.15.
        let o = g.observe(&m(0.04));
        assert_eq!((o.windowed, o.breach), (0.04, None));
        assert_eq!(g.commit(false), None);
        let o = g.observe(&m(0.16));
        assert!((o.windowed - 0.10).abs() < 1e-15 && o.breach.is_none(), "{o:?}");
        g.commit(false);
        let o = g.observe(&m(0.2));
        assert!((o.windowed - 0.15).abs() < 1e-15 && o.breach == Some(Breach::Line), "{o:?}");
        // Patience 2: the first recipe breach waits, the second falls back to rung 1.
        assert_eq!(g.commit(true), None);
        assert_eq!(g.observe(&m(0.2)).breach, Some(Breach::Line));
        assert_eq!(g.commit(true), Some(1));
        g.switched(1);
        assert_eq!((g.serving().as_str(), g.state.fallbacks, g.state.ema_bits), ("fp8", 1, None));
        // On the last rung there is nothing left.
        g.switched(2);
        g.observe(&m(1.0));
        g.commit(true);
        g.observe(&m(1.0));
        assert_eq!(g.commit(true), None);
    }

    #[test]
    fn last_m_window_and_statistics() {
        let c = cfg(|c| {
            c.window = Window::Last(3);
            c.statistic = "q01".into();
        });
        let mut g = Guard::new(&c, None, "nvfp4+first-layer").unwrap();
        assert_eq!(g.serving(), "nvfp4+first-layer");
        assert_eq!(g.next_rung(), Some(0));
        // q01 = −2d: values 0.02, 0.04, 0.06, 0.30 → windows 0.02, 0.03, 0.04, (0.04+0.06+0.30)/3.
        let want = [0.02, 0.03, 0.04, 0.4 / 3.0];
        for (d, w) in [0.01, 0.02, 0.03, 0.15].iter().zip(want) {
            let o = g.observe(&m(*d));
            assert!((o.windowed - w).abs() < 1e-15, "{o:?} want {w}");
            g.commit(o.breach.is_some());
        }
        assert_eq!(g.state.breaches, 1);
        assert_eq!(g.state.window_bits.len(), 3);
    }

    #[test]
    fn jump_rule_needs_history_and_the_floor_and_a_dropped_step_leaves_no_trace() {
        let c = cfg(|c| {
            c.line = Line::Value(10.0);
            c.jump = 5.0;
            c.jump_floor = 0.01;
            c.warmup_steps = 3;
        });
        let mut g = Guard::new(&c, Some(0), "nvfp4").unwrap();
        // Before the warm-up a jump is not judged.
        g.observe(&m(0.002));
        g.commit(false);
        assert_eq!(g.observe(&m(0.5)).breach, None);
        g.drop_step();
        assert_eq!((g.state.observed, g.state.history_bits.len()), (1, 1));
        for _ in 0..4 {
            g.observe(&m(0.002));
            g.commit(false);
        }
        // Median 0.002: 0.011 is above the floor and 5.5× the median.
        assert_eq!(g.observe(&m(0.011)).breach, Some(Breach::Jump));
        // 0.009 is 4.5×: no jump; 0.008 against a median of 0.0005 is below the floor.
        assert_eq!(g.observe(&m(0.009)).breach, None);
        let mut h = Guard::new(&c, Some(0), "nvfp4").unwrap();
        for _ in 0..5 {
            h.observe(&m(0.0005));
            h.commit(false);
        }
        assert_eq!(h.observe(&m(0.008)).breach, None);
        // A non-finite step is neither a breach nor history.
        assert_eq!(h.observe(&m(f64::NAN)).breach, None);
        h.commit(false);
        assert_eq!(h.state.history_bits.len(), 5);
    }

    #[test]
    fn lines_and_bad_settings_name_their_key() {
        let line = |l: Line, edit: fn(&mut GuardConfig)| {
            let mut c = cfg(|c| c.line = l);
            edit(&mut c);
            c.line_value()
        };
        assert!((line(Line::Named("admit".into()), |_| {}).unwrap() - 0.184 / 1.5).abs() < 1e-15);
        assert_eq!(line(Line::Named("bracket".into()), |c| c.bracket = Some([0.01, 0.04])).unwrap(), 0.01);
        let bad: Vec<(GuardConfig, &str)> = vec![
            (cfg(|c| c.statistic = "kl".into()), "guard.statistic: unknown statistic 'kl'"),
            (cfg(|c| c.fallback.clear()), "guard.fallback: the ladder is empty"),
            (cfg(|c| c.window = Window::Last(0)), "guard.window: last = 0"),
            (cfg(|c| c.window = Window::Ema(0.0)), "guard.window: ema = 0"),
            (cfg(|c| c.line = Line::Named("bracket".into())), "needs guard.bracket"),
            (cfg(|c| c.line = Line::Named("budget".into())), "guard.line: expected a number"),
            (cfg(|c| c.line = Line::Value(-1.0)), "guard.line: must be a positive"),
            (cfg(|c| c.jump = 0.5), "guard.jump"),
            (cfg(|c| c.patience = 0), "guard.patience"),
            (cfg(|c| c.alpha = 0.5), "guard.alpha"),
        ];
        for (c, want) in bad {
            let e = format!("{:#}", c.validate().unwrap_err());
            assert!(e.contains(want), "{e} lacks {want}");
        }
        // Off: nothing is checked.
        assert!(GuardConfig { statistic: "kl".into(), ..Default::default() }.validate().is_ok());
    }

    #[test]
    fn decisions_are_a_function_of_the_values_and_survive_a_restore() {
        let c = cfg(|c| c.jump = 4.0);
        let xs: Vec<f64> =
            (0..40).map(|i| 0.01 + 0.003 * ((i * 7 % 11) as f64) + if i == 30 { 0.2 } else { 0.0 }).collect();
        let run = |g: &mut Guard, xs: &[f64]| -> Vec<(Option<Breach>, Option<usize>)> {
            xs.iter()
                .map(|&x| {
                    let o = g.observe(&m(x));
                    (o.breach, g.commit(o.breach.is_some()))
                })
                .collect()
        };
        let mut a = Guard::new(&c, Some(0), "nvfp4").unwrap();
        let straight = run(&mut a, &xs);
        assert!(straight.iter().any(|x| x.0.is_some()), "{straight:?}");
        let mut b = Guard::new(&c, Some(0), "nvfp4").unwrap();
        let mut resumed = run(&mut b, &xs[..20]);
        let saved: GuardState = serde_json::from_str(&serde_json::to_string(&b.state).unwrap()).unwrap();
        let mut b2 = Guard::new(&c, Some(0), "nvfp4").unwrap();
        b2.restore(saved);
        resumed.extend(run(&mut b2, &xs[20..]));
        assert_eq!(straight, resumed);
    }
}
