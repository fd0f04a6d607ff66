//! Evaluation of parsed answers (the answer rule of seed 004 App. B.1 / seed 000 App. G, "a rule
//! checks the last boxed answer"; what counts as equal follows math-verify 0.8.0).
//!
//! Owns: the points variables are evaluated at ([`Ctx`]), exact rational evaluation (checked
//! `i128`), floating evaluation (real, `None` when undefined or not finite: `\sqrt{-1}`, `1/0`,
//! `2^{99999}`), a sign-and-logarithm fallback for huge products of powers, and [`scalar_same`]:
//! two numbers are equal exactly, or within a relative 1e-9, or — when one side is a decimal
//! literal and the other no integer — rounded to 6 decimals, as math-verify does (`1/3` is
//! `0.333333`, not `0.33`).
//! May call: `super::math_expr`, `super::math_lex` (function names). Must not: parse strings or
//! compare structure (that is `math_cmp`).

use super::math_expr::Node;
use super::math_lex::Fun;

/// How many points an expression with variables is compared at.
pub const POINTS: usize = 5;

/// What a comparison needs: the variables' values at each point and the percent reading of each side
/// (`pct[0]` for the reference, `pct[1]` for the answer: 1 reads `10\%` as 10, 0.01 as 0.1).
pub struct Ctx {
    /// Variable names, sorted; `values[k][j]` is variable `j` at point `k`.
    pub vars: Vec<String>,
    values: Vec<Vec<f64>>,
    /// Percent scale of the reference and of the answer.
    pub pct: [f64; 2],
}

impl Ctx {
    /// A context for comparing `a` with `b`: their variables get fixed, irrational-looking values
    /// of magnitude in (0.6, 2.1), different for each variable and point, negative at odd points
    /// (so `|x|` is not `x`); a point where only one side is defined (`\sqrt{x}`) is skipped.
    pub fn new(a: &Node, b: &Node, pct: [f64; 2]) -> Ctx {
        let mut vars = Vec::new();
        collect_vars(a, &mut vars);
        collect_vars(b, &mut vars);
        vars.sort();
        vars.dedup();
        let values = (0..POINTS)
            .map(|k| {
                (0..vars.len())
                    .map(|j| {
                        let t = (j as f64 + 1.0) * 0.754_877_666_246_692_7 + (k as f64 + 1.0) * 0.569_840_290_998_053_2;
                        let sign = if k % 2 == 1 { -1.0 } else { 1.0 };
                        sign * (0.6 + t.fract() * 1.5)
                    })
                    .collect()
            })
            .collect();
        Ctx { vars, values, pct }
    }
}

/// Appends the variable names in `n` to `out`.
pub fn collect_vars(n: &Node, out: &mut Vec<String>) {
    if let Node::Var(v) = n {
        out.push(v.clone());
    }
    for c in children(n) {
        collect_vars(c, out);
    }
}

/// The direct children of a node.
pub fn children(n: &Node) -> Vec<&Node> {
    use Node::*;
    match n {
        Num(_) | Pi | E | Inf | Var(_) | Text(_) => Vec::new(),
        Neg(a) | Fact(a) | Func(_, a) | Abs(a) | Percent(a) => vec![a],
        Pow(a, b) | Binom(a, b) | Log(a, b) => vec![a, b],
        Root(i, a) => i.iter().map(|b| &**b).chain([&**a]).collect(),
        Interval { lo, hi, .. } => vec![lo, hi],
        Prod(fs) => fs.iter().map(|(f, _)| f).collect(),
        Sum(v) | Tuple(v) | Set(v) | Union(v) | Rel(v, _) => v.iter().collect(),
        Matrix(rows) => rows.iter().flatten().collect(),
    }
}

/// Whether a `\%` occurs anywhere in `n`.
pub fn has_percent(n: &Node) -> bool {
    matches!(n, Node::Percent(_)) || children(n).into_iter().any(has_percent)
}

/// An exact rational n/d, d > 0, in lowest terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Q(i128, i128);

fn gcd(a: i128, b: i128) -> Option<i128> {
    let (mut a, mut b) = (a.unsigned_abs(), b.unsigned_abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    i128::try_from(a).ok()
}

impl Q {
    fn new(n: i128, d: i128) -> Option<Q> {
        if d == 0 {
            return None;
        }
        let g = gcd(n, d)?.max(1);
        let s = if d < 0 { -1 } else { 1 };
        Some(Q(n.checked_div(g)?.checked_mul(s)?, d.checked_div(g)?.checked_mul(s)?))
    }
    fn add(self, o: Q) -> Option<Q> {
        Q::new(self.0.checked_mul(o.1)?.checked_add(o.0.checked_mul(self.1)?)?, self.1.checked_mul(o.1)?)
    }
    fn mul(self, o: Q) -> Option<Q> {
        Q::new(self.0.checked_mul(o.0)?, self.1.checked_mul(o.1)?)
    }
    fn inv(self) -> Option<Q> {
        Q::new(self.1, self.0)
    }
    fn int(self) -> Option<i128> {
        (self.1 == 1).then_some(self.0)
    }
}

fn literal_q(s: &str) -> Option<Q> {
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    if frac.len() > 30 {
        return None;
    }
    let digits: i128 = format!("{int}{frac}").parse().ok()?;
    Q::new(digits, 10i128.checked_pow(frac.len() as u32)?)
}

/// The exact value of a rational-valued node, if it has one that fits in `i128`.
fn exact(n: &Node, pct: Q) -> Option<Q> {
    use Node::*;
    match n {
        Num(s) => literal_q(s),
        Neg(a) => exact(a, pct)?.mul(Q(-1, 1)),
        Sum(v) => v.iter().try_fold(Q(0, 1), |acc, t| acc.add(exact(t, pct)?)),
        Prod(fs) => fs.iter().try_fold(Q(1, 1), |acc, (f, div)| {
            let x = exact(f, pct)?;
            acc.mul(if *div { x.inv()? } else { x })
        }),
        Pow(b, e) => {
            let (b, e) = (exact(b, pct)?, exact(e, pct)?.int()?);
            if e.abs() > 256 {
                return None;
            }
            let mut r = Q(1, 1);
            for _ in 0..e.abs() {
                r = r.mul(b)?;
            }
            if e < 0 {
                r.inv()
            } else {
                Some(r)
            }
        }
        Fact(a) => {
            let k = exact(a, pct)?.int()?;
            (0..=33).contains(&k).then(|| (1..=k).product::<i128>()).map(|p| Q(p, 1))
        }
        Binom(a, b) => {
            let (n, k) = (exact(a, pct)?, exact(b, pct)?.int()?);
            if !(0..=1000).contains(&k) {
                return None;
            }
            let k = match n.int() {
                Some(m) if m >= 0 && k > m => return Some(Q(0, 1)),
                Some(m) if m >= 0 => k.min(m - k),
                _ => k,
            };
            (0..k).try_fold(Q(1, 1), |acc, i| acc.mul(n.add(Q(-i, 1))?)?.mul(Q(1, i + 1)))
        }
        Abs(a) => exact(a, pct).and_then(|q| Some(Q(q.0.checked_abs()?, q.1))),
        Percent(a) => exact(a, pct)?.mul(pct),
        _ => None,
    }
}

/// The floating value of an arithmetic node at one point; `None` if undefined, not finite (except
/// a literal ±∞) or not arithmetic.
pub fn eval(n: &Node, cx: &Ctx, k: usize, side: usize) -> Option<f64> {
    use Node::*;
    let ev = |m: &Node| eval(m, cx, k, side).filter(|x| x.is_finite());
    let v = match n {
        Num(s) => s.parse::<f64>().ok()?,
        Pi => std::f64::consts::PI,
        E => std::f64::consts::E,
        Inf => return Some(f64::INFINITY),
        Var(name) => *cx.values.get(k)?.get(cx.vars.iter().position(|v| v == name)?)?,
        Neg(a) => return eval(a, cx, k, side).map(|x| -x),
        Sum(v) => v.iter().try_fold(0.0, |acc, t| Some(acc + ev(t)?))?,
        Prod(fs) => fs.iter().try_fold(1.0, |acc, (f, div)| {
            let x = ev(f)?;
            if *div {
                (x != 0.0).then(|| acc / x)
            } else {
                Some(acc * x)
            }
        })?,
        Pow(b, e) => power(ev(b)?, ev(e)?)?,
        Root(i, a) => {
            let x = ev(a)?;
            let deg = match i {
                Some(i) => ev(i)?,
                None => 2.0,
            };
            let odd = deg.fract() == 0.0 && deg.rem_euclid(2.0) == 1.0;
            if deg == 2.0 {
                (x >= 0.0).then(|| x.sqrt())?
            } else if x < 0.0 && odd {
                -(-x).powf(1.0 / deg)
            } else {
                power(x, 1.0 / deg)?
            }
        }
        Fact(a) => {
            let x = ev(a)?;
            if x.fract() != 0.0 || !(0.0..=170.0).contains(&x) {
                return None;
            }
            (1..=x as u32).map(f64::from).product()
        }
        Binom(a, b) => {
            // Generalized: (n choose k) = n(n-1)…(n-k+1)/k! for an integer k in 0..=1000.
            let (n, r) = (ev(a)?, ev(b)?);
            if r.fract() != 0.0 || !(0.0..=1000.0).contains(&r) {
                return None;
            }
            let whole = n.fract() == 0.0 && n >= 0.0;
            let r = if whole && r > n {
                return Some(0.0);
            } else if whole {
                r.min(n - r)
            } else {
                r
            };
            (0..r as u32).fold(1.0, |acc, i| acc * (n - f64::from(i)) / f64::from(i + 1))
        }
        Func(f, a) => function(*f, ev(a)?)?,
        Log(b, a) => {
            let (b, x) = (ev(b)?, ev(a)?);
            if b <= 0.0 || b == 1.0 || x <= 0.0 {
                return None;
            }
            x.ln() / b.ln()
        }
        Abs(a) => ev(a)?.abs(),
        Percent(a) => ev(a)? * cx.pct[side],
        Tuple(_) | Interval { .. } | Set(_) | Union(_) | Rel(..) | Matrix(_) | Text(_) => return None,
    };
    v.is_finite().then_some(v)
}

fn power(b: f64, e: f64) -> Option<f64> {
    if e.fract() == 0.0 && e.abs() <= 4096.0 {
        if b == 0.0 && e < 0.0 {
            return None;
        }
        return Some(b.powi(e as i32));
    }
    (b >= 0.0).then(|| b.powf(e))
}

fn function(f: Fun, x: f64) -> Option<f64> {
    Some(match f {
        Fun::Sin => x.sin(),
        Fun::Cos => x.cos(),
        Fun::Tan => x.tan(),
        Fun::Cot => 1.0 / x.tan(),
        Fun::Sec => 1.0 / x.cos(),
        Fun::Csc => 1.0 / x.sin(),
        Fun::Asin => return (x.abs() <= 1.0).then(|| x.asin()),
        Fun::Acos => return (x.abs() <= 1.0).then(|| x.acos()),
        Fun::Atan => x.atan(),
        Fun::Sinh => x.sinh(),
        Fun::Cosh => x.cosh(),
        Fun::Tanh => x.tanh(),
        Fun::Ln => return (x > 0.0).then(|| x.ln()),
        Fun::Exp => x.exp(),
    })
}

/// Equal within a relative 1e-9 (absolute 1e-12 near zero); infinities only to themselves.
pub fn close(a: f64, b: f64) -> bool {
    if a.is_infinite() || b.is_infinite() {
        return a == b;
    }
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()) + 1e-12
}

/// math-verify's reading of a decimal literal: both sides rounded to 6 decimals.
fn close6(a: f64, b: f64) -> bool {
    if a.abs() < 1e9 && b.abs() < 1e9 {
        (a * 1e6).round() == (b * 1e6).round()
    } else {
        close(a, b)
    }
}

fn is_decimal(n: &Node) -> bool {
    match n {
        Node::Num(s) => s.contains('.'),
        Node::Neg(a) | Node::Percent(a) => is_decimal(a),
        _ => false,
    }
}

/// Two arithmetic nodes (reference `g`, answer `p`): exactly when both are rationals (a decimal
/// against a non-integer rounded to 6 places), else by floating values at each point, else by
/// sign and logarithm. `None`: no point where both are defined.
pub fn scalar_same(g: &Node, p: &Node, cx: &Ctx) -> Option<bool> {
    let q = |s: usize| if cx.pct[s] == 1.0 { Q(1, 1) } else { Q(1, 100) };
    let decimal = is_decimal(g) || is_decimal(p);
    if cx.vars.is_empty() {
        if let (Some(a), Some(b)) = (exact(g, q(0)), exact(p, q(1))) {
            // A decimal against a non-integer is rounded to 6 places (1/3 = 0.333333, as in
            // math-verify); against an integer, or without decimals, it is exact (1 ≠ 0.9999999).
            let integer = |n: &Node, x: Q| !is_decimal(n) && x.1 == 1;
            if !decimal || integer(g, a) || integer(p, b) {
                return Some(a == b);
            }
        }
    }
    let mut compared = 0;
    for k in 0..POINTS.min(if cx.vars.is_empty() { 1 } else { POINTS }) {
        if let (Some(a), Some(b)) = (eval(g, cx, k, 0), eval(p, cx, k, 1)) {
            let integer = |n: &Node, x: f64| !is_decimal(n) && x.fract() == 0.0;
            let rounded = decimal && !integer(g, a) && !integer(p, b);
            if !(if rounded { close6(a, b) } else { close(a, b) }) {
                return Some(false);
            }
            compared += 1;
        }
    }
    if compared > 0 {
        return Some(true);
    }
    // Too large for f64 (`2^{2023}` vs `2^{2022}`): compare sign and logarithm of products of powers.
    let (a, b) = (log_abs(g, cx, 0)?, log_abs(p, cx, 1)?);
    Some(a.0 == b.0 && (a.1 - b.1).abs() <= 1e-12 * a.1.abs().max(b.1.abs()).max(1.0))
}

/// (sign, ln |value|) of a constant made of numbers, π, e, products, powers and roots (no sums,
/// whose cancellation a logarithm cannot see).
fn log_abs(n: &Node, cx: &Ctx, side: usize) -> Option<(f64, f64)> {
    use Node::*;
    let ln = |x: f64| (x != 0.0 && x.is_finite()).then(|| (x.signum(), x.abs().ln()));
    let pow = |b: (f64, f64), e: f64| -> Option<(f64, f64)> {
        let sign = if b.0 > 0.0 {
            1.0
        } else if e.fract() == 0.0 && e.abs() < 9e15 {
            if e.rem_euclid(2.0) == 0.0 {
                1.0
            } else {
                -1.0
            }
        } else {
            return None;
        };
        Some((sign, e * b.1)).filter(|r| r.1.is_finite())
    };
    match n {
        Num(_) | Pi | E => ln(eval(n, cx, 0, side)?),
        Neg(a) => log_abs(a, cx, side).map(|(s, l)| (-s, l)),
        Percent(a) => log_abs(a, cx, side).map(|(s, l)| (s, l + cx.pct[side].ln())),
        Prod(fs) => fs.iter().try_fold((1.0, 0.0), |(s, l), (f, div)| {
            let (fs, fl) = log_abs(f, cx, side)?;
            Some((s * fs, if *div { l - fl } else { l + fl }))
        }),
        Pow(b, e) => pow(log_abs(b, cx, side)?, eval(e, cx, 0, side)?),
        Root(i, a) => {
            let deg = match i {
                Some(i) => eval(i, cx, 0, side)?,
                None => 2.0,
            };
            let (s, l) = log_abs(a, cx, side)?;
            let odd = deg.fract() == 0.0 && deg.rem_euclid(2.0) == 1.0;
            (s > 0.0 || odd).then_some((s, l / deg)).filter(|r| r.1.is_finite())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::super::math_expr::parse;
    use super::*;

    fn same_numbers(g: &str, p: &str) -> Option<bool> {
        let (g, p) = (parse(g)?, parse(p)?);
        scalar_same(&g, &p, &Ctx::new(&g, &p, [1.0, 1.0]))
    }

    #[test]
    fn numbers_are_exact_unless_a_decimal_meets_a_fraction() {
        assert_eq!(same_numbers("2^{100}", "1267650600228229401496703205376"), Some(true));
        assert_eq!(same_numbers("2^{100}+1", "1267650600228229401496703205376"), Some(false));
        assert_eq!(same_numbers("1/3", "0.333333"), Some(true));
        assert_eq!(same_numbers("1/3", "0.3333"), Some(false));
        assert_eq!(same_numbers("1", "0.9999999"), Some(false));
        assert_eq!(same_numbers("\\sqrt{2}", "1.414214"), Some(true));
        assert_eq!(same_numbers("\\sqrt{2}\\sqrt{3}", "\\sqrt{6}"), Some(true));
        assert_eq!(same_numbers("3^{999}", "3^{1000}/3"), Some(true)); // by logarithms
        assert_eq!(same_numbers("3^{999}", "3^{1000}"), Some(false));
        assert_eq!(same_numbers("1/0", "1"), None);
        assert_eq!(same_numbers("\\ln(-1)", "1"), None);
    }

    #[test]
    fn variables_are_compared_at_fixed_points() {
        assert_eq!(same_numbers("(x+y)^2", "x^2+2xy+y^2"), Some(true));
        assert_eq!(same_numbers("(x+y)^2", "x^2+y^2"), Some(false));
        assert_eq!(same_numbers("\\sqrt{x^2}", "x"), Some(false)); // x < 0 at some points
        assert_eq!(same_numbers("\\sqrt{x}^2", "x"), Some(true)); // points where √x is undefined skip
    }
}
