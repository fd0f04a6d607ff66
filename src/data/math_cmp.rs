//! Structural comparison of parsed answers (the answer rule of seed 004 App. B.1 / seed 000
//! App. G, "a rule checks the last boxed answer"; the equivalences follow math-verify 0.8.0).
//!
//! Owns: [`compare`] and [`same`]: tuples in order, sets, bare lists and unions in any order,
//! intervals with their brackets (infinite ends open), matrices cell by cell, relations up to a
//! constant factor (`x > 3` against an interval as one), texts by letters, lone symbols without
//! case, the percent readings and math-verify's unwrapping of equations (`x = 5`, `m+n=23`).
//! May call: `super::math_eval`, `super::math_expr`. Must not: parse strings or evaluate numbers
//! itself (that is `math_eval`).

use super::math_eval::{close, collect_vars, eval, has_percent, scalar_same, Ctx, POINTS};
use super::math_expr::{Node, RelOp};

/// All of several verdicts: false if one is false, else undecided if one is, else true.
fn all(vs: impl IntoIterator<Item = Option<bool>>) -> Option<bool> {
    let mut undecided = false;
    for v in vs {
        match v {
            Some(false) => return Some(false),
            None => undecided = true,
            Some(true) => {}
        }
    }
    if undecided {
        None
    } else {
        Some(true)
    }
}

/// Any of several verdicts: true if one is true, else undecided if one is, else false.
fn any(vs: impl IntoIterator<Item = Option<bool>>) -> Option<bool> {
    let mut undecided = false;
    for v in vs {
        match v {
            Some(true) => return Some(true),
            None => undecided = true,
            Some(false) => {}
        }
    }
    if undecided {
        None
    } else {
        Some(false)
    }
}

/// Same elements, in any order, duplicates ignored.
fn set_same(g: &[Node], p: &[Node], cx: &Ctx) -> Option<bool> {
    let covered = |a: &[Node], b: &[Node], flip: bool| {
        all(a.iter().map(|x| any(b.iter().map(|y| if flip { same(y, x, cx) } else { same(x, y, cx) }))))
    };
    all([covered(g, p, false), covered(p, g, true)])
}

/// The reference `g` and the answer `p` are the same: `Some(true)`, different: `Some(false)`,
/// or undecidable by this rule: `None`. Equations are first unwrapped as in [`compare`].
pub fn same(g: &Node, p: &Node, cx: &Ctx) -> Option<bool> {
    let (g, p) = (canon_interval(g), canon_interval(p));
    match unwrap_relations(&g, &p) {
        Some((g, p)) => same_unwrapped(&g, &p, cx),
        None => same_unwrapped(&g, &p, cx),
    }
}

fn same_unwrapped(g: &Node, p: &Node, cx: &Ctx) -> Option<bool> {
    use Node::*;
    match (g, p) {
        (Text(a), Text(b)) => Some(a.to_lowercase() == b.to_lowercase()),
        (Text(_), _) | (_, Text(_)) => None,
        // A lone symbol is a name or a choice letter: case does not matter (as in math-verify).
        (Var(a), Var(b)) if a.to_lowercase() == b.to_lowercase() => Some(true),
        (Rel(..), Rel(..)) => rel_same(g, p, cx),
        (Rel(..), Tuple(_) | Interval { .. } | Union(_)) => match rel_to_interval(g) {
            Some(set) => same(&set, p, cx),
            None => Some(false),
        },
        (Rel(..), _) | (_, Rel(..)) => Some(false),
        (Tuple(a), Tuple(b)) | (Tuple(a), Set(b)) => {
            if a.len() == b.len() {
                all(a.iter().zip(b).map(|(x, y)| same(x, y, cx)))
            } else {
                Some(false)
            }
        }
        (
            Interval { lo: l1, hi: h1, lo_closed: a1, hi_closed: b1 },
            Interval { lo: l2, hi: h2, lo_closed: a2, hi_closed: b2 },
        ) => {
            if a1 != a2 || b1 != b2 {
                return Some(false);
            }
            all([same(l1, l2, cx), same(h1, h2, cx)])
        }
        (Matrix(a), Matrix(b)) => {
            let shape = |m: &Vec<Vec<Node>>| m.iter().map(Vec::len).collect::<Vec<_>>();
            if shape(a) != shape(b) {
                return Some(false);
            }
            all(a.iter().flatten().zip(b.iter().flatten()).map(|(x, y)| same(x, y, cx)))
        }
        (Union(a), Union(b)) | (Set(a), Set(b)) | (Set(a), Tuple(b)) => set_same(a, b, cx),
        (Set(a), x) if is_scalar(x) => set_same(a, std::slice::from_ref(x), cx),
        (x, Set(b)) if is_scalar(x) => set_same(std::slice::from_ref(x), b, cx),
        (x, y) if is_scalar(x) && is_scalar(y) => scalar_same(x, y, cx),
        _ => Some(false),
    }
}

fn is_inf(n: &Node) -> bool {
    matches!(n, Node::Inf) || matches!(n, Node::Neg(a) if matches!(**a, Node::Inf))
}

/// An interval's infinite ends are open (`(0, \infty]` is `(0, \infty)`, as in sympy); an
/// interval open at both ends is the pair `(a, b)`.
fn canon_interval(n: &Node) -> std::borrow::Cow<'_, Node> {
    use std::borrow::Cow;
    let Node::Interval { lo, hi, lo_closed, hi_closed } = n else { return Cow::Borrowed(n) };
    let (lc, hc) = (*lo_closed && !is_inf(lo), *hi_closed && !is_inf(hi));
    if lc || hc {
        if (lc, hc) == (*lo_closed, *hi_closed) {
            return Cow::Borrowed(n);
        }
        return Cow::Owned(Node::Interval { lo: lo.clone(), hi: hi.clone(), lo_closed: lc, hi_closed: hc });
    }
    Cow::Owned(Node::Tuple(vec![(**lo).clone(), (**hi).clone()]))
}

/// `lhs - rhs` of the relation `terms[i] op terms[i+1]`.
fn diff(terms: &[Node], i: usize) -> Option<Node> {
    Some(Node::Sum(vec![terms.get(i)?.clone(), Node::Neg(Box::new(terms.get(i + 1)?.clone()))]))
}

/// Relations: link by link (or all links reversed), each `lhs - rhs` equal up to a constant
/// factor — positive for the same inequality, negative for the flipped one, any for `=`/`\ne`.
fn rel_same(g: &Node, p: &Node, cx: &Ctx) -> Option<bool> {
    let (Node::Rel(gt, go), Node::Rel(pt, po)) = (g, p) else { return Some(false) };
    if go.len() != po.len() {
        return Some(false);
    }
    let n = go.len();
    let link = |i: usize, j: usize| -> Option<bool> {
        let (a, b) = (go[i], po[j]);
        let sign = if a == b && matches!(a, RelOp::Eq | RelOp::Ne) {
            0.0
        } else if a == b {
            1.0
        } else if flipped(a) == b {
            -1.0
        } else {
            return Some(false);
        };
        proportional(&diff(gt, i)?, &diff(pt, j)?, sign, cx)
    };
    let forward = all((0..n).map(|i| link(i, i)));
    if forward == Some(true) || n == 0 {
        return forward;
    }
    any([forward, all((0..n).map(|i| link(i, n - 1 - i)))])
}

fn flipped(op: RelOp) -> RelOp {
    match op {
        RelOp::Lt => RelOp::Gt,
        RelOp::Gt => RelOp::Lt,
        RelOp::Le => RelOp::Ge,
        RelOp::Ge => RelOp::Le,
        o => o,
    }
}

/// Whether `a = r·b` at every point for one constant r (of the sign `sign` unless it is 0).
fn proportional(a: &Node, b: &Node, sign: f64, cx: &Ctx) -> Option<bool> {
    let points = if cx.vars.is_empty() { 1 } else { POINTS };
    let vals: Vec<(f64, f64)> = (0..points).filter_map(|k| Some((eval(a, cx, k, 0)?, eval(b, cx, k, 1)?))).collect();
    let (&(a0, b0), _) = vals.iter().map(|v| (v, v.1.abs())).max_by(|x, y| x.1.total_cmp(&y.1))?;
    if b0.abs() <= 1e-12 {
        return Some(vals.iter().all(|(x, _)| x.abs() <= 1e-12));
    }
    let r = a0 / b0;
    if cx.vars.is_empty() && (r - 1.0).abs() > 1e-9 && (r + 1.0).abs() > 1e-9 {
        return Some(false);
    }
    if r.abs() <= 1e-12 || sign * r < 0.0 {
        return Some(false);
    }
    Some(vals.iter().all(|&(x, y)| close(x, r * y)))
}

/// `x > 3` as `(3, ∞)`, `2 \le x < 5` as `[2, 5)` (math-verify turns a reference relation into a
/// set when the answer is one).
fn rel_to_interval(n: &Node) -> Option<Node> {
    let Node::Rel(t, ops) = n else { return None };
    let has_var = |m: &Node| {
        let mut v = Vec::new();
        collect_vars(m, &mut v);
        !v.is_empty()
    };
    let mk = |lo: Node, hi: Node, lc: bool, hc: bool| {
        if !lc && !hc {
            Node::Tuple(vec![lo, hi])
        } else {
            Node::Interval { lo: Box::new(lo), hi: Box::new(hi), lo_closed: lc, hi_closed: hc }
        }
    };
    let neg_inf = || Node::Neg(Box::new(Node::Inf));
    let closed = |o: RelOp| matches!(o, RelOp::Le | RelOp::Ge);
    let up = |o: RelOp| matches!(o, RelOp::Lt | RelOp::Le);
    let down = |o: RelOp| matches!(o, RelOp::Gt | RelOp::Ge);
    match (t.as_slice(), ops.as_slice()) {
        ([a, b], [o]) if matches!(a, Node::Var(_)) && !has_var(b) && (up(*o) || down(*o)) => Some(if up(*o) {
            mk(neg_inf(), b.clone(), false, closed(*o))
        } else {
            mk(b.clone(), Node::Inf, closed(*o), false)
        }),
        ([a, b], [o]) if matches!(b, Node::Var(_)) && !has_var(a) => {
            rel_to_interval(&Node::Rel(vec![b.clone(), a.clone()], vec![flipped(*o)]))
        }
        ([a, Node::Var(_), c], [o1, o2]) if !has_var(a) && !has_var(c) => {
            if up(*o1) && up(*o2) {
                Some(mk(a.clone(), c.clone(), closed(*o1), closed(*o2)))
            } else if down(*o1) && down(*o2) {
                Some(mk(c.clone(), a.clone(), closed(*o2), closed(*o1)))
            } else {
                None
            }
        }
        _ => None,
    }
}

/// Whether `n` is `a = b (= …)` only.
fn is_eq(n: &Node) -> bool {
    matches!(n, Node::Rel(_, ops) if ops.iter().all(|o| *o == RelOp::Eq))
}

/// An equation whose left side is made of symbols only (`x = 5`, `xy = 5`, `m + n = 23`): an
/// assignment (latex2sympy's `is_expr_of_only_symbols`).
fn is_assignment(n: &Node) -> bool {
    fn symbols(m: &Node) -> bool {
        match m {
            Node::Var(_) => true,
            Node::Sum(v) => v.iter().all(symbols),
            Node::Prod(fs) => fs.iter().all(|(f, _)| symbols(f)),
            _ => false,
        }
    }
    is_eq(n) && matches!(n, Node::Rel(t, _) if t.first().is_some_and(symbols))
}

/// math-verify's reading of equations, applied to every compared pair: an assignment keeps its
/// first left side and last right side; an answer equation against a reference that is none is
/// read as its last right side (`m+n=23` vs `23`); a reference assignment against an answer that
/// is no equation is read as its right side (`x = 5` vs `5`). `None`: nothing to change.
fn unwrap_relations(g: &Node, p: &Node) -> Option<(Node, Node)> {
    let (ga, pa) = (is_assignment(g), is_assignment(p));
    let (ge, pe) = (is_eq(g), is_eq(p));
    let chain_ends = |n: &Node| match n {
        Node::Rel(t, _) if t.len() > 2 => Some(Node::Rel(vec![t.first()?.clone(), t.last()?.clone()], vec![RelOp::Eq])),
        _ => Some(n.clone()),
    };
    let last = |n: &Node| match n {
        Node::Rel(t, _) => t.last().cloned(),
        _ => None,
    };
    if pe && !ge {
        Some((g.clone(), last(p)?))
    } else if ga && !pe {
        Some((last(g)?, p.clone()))
    } else if (ga || pa) && (matches!(g, Node::Rel(t, _) if t.len() > 2) || matches!(p, Node::Rel(t, _) if t.len() > 2))
    {
        Some((if ga { chain_ends(g)? } else { g.clone() }, if pa { chain_ends(p)? } else { p.clone() }))
    } else {
        None
    }
}

/// Compares a parsed reference `g` with a parsed answer `p` (see [`same`]). When one side has a
/// `\%`, it is read both as written (GSM8K references drop the sign: `10\%` is `10`) and divided
/// by 100 (math-verify's reading: `10\%` is `0.1`); when both have one, they are read alike (so
/// `10\%` is not `0.1\%`). `Some(true)`: same; `Some(false)`: different; `None`: undecided.
pub fn compare(g: &Node, p: &Node) -> Option<bool> {
    let readings: &[[f64; 2]] = match (has_percent(g), has_percent(p)) {
        (false, false) => &[[1.0, 1.0]],
        (true, false) => &[[1.0, 1.0], [0.01, 1.0]],
        (false, true) => &[[1.0, 1.0], [1.0, 0.01]],
        (true, true) => &[[1.0, 1.0], [0.01, 0.01]],
    };
    any(readings.iter().map(|&pct| same(g, p, &Ctx::new(g, p, pct))))
}

fn is_scalar(n: &Node) -> bool {
    !matches!(
        n,
        Node::Tuple(_)
            | Node::Interval { .. }
            | Node::Set(_)
            | Node::Union(_)
            | Node::Rel(..)
            | Node::Matrix(_)
            | Node::Text(_)
    )
}
