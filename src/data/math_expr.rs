//! The LaTeX answer parser of the answer rule (seed 004 App. B.1 / seed 000 App. G: "a rule checks
//! the last boxed answer"; the notations read and how follow math-verify 0.8.0 / latex2sympy).
//!
//! Owns: parsing the tokens of a cleaned answer (`math_lex`, `math_norm::clean`) into a [`Node`] tree:
//! numbers (thousands commas, decimals, leading zeros), variables, `\pi`, `e`, `\infty`, `+ - \cdot
//! \times / \div`, implicit products, TeX shorthand arguments (`\frac12`, `\sqrt3`, `x^23`), mixed
//! numbers (`3\frac12`), powers, `!`, `\%`, `\sqrt[n]{}`, `\binom`, `|x|`, `\sin`…`\ln`, `\log_b`,
//! relations, tuples, intervals, sets, `\cup`, bare comma lists, matrices, `\text{}` and units.
//! May call: `super::math_lex`. Must not: evaluate or compare (`math_eval`, `math_cmp`), allocate
//! without bound (inputs over [`MAX_LEN`] characters and nesting over [`MAX_DEPTH`] are refused).

use super::math_lex::{function_named, tokenize, Fun, Tok as T};

/// Longest answer (in characters) the parser accepts.
pub const MAX_LEN: usize = 1000;
/// Deepest nesting (brackets, braces, unary signs, command arguments) the parser accepts.
pub const MAX_DEPTH: usize = 40;

/// A parsed answer. Arithmetic nodes evaluate to numbers; the others are structure.
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    /// A number literal as written, thousands commas and leading `+` removed (`"017"`, `"0.50"`).
    Num(String),
    /// π.
    Pi,
    /// Euler's number (the letter `e`).
    E,
    /// ∞.
    Inf,
    /// A variable: a letter or Greek letter, with its subscript or primes (`x`, `x_1`, `\theta`).
    Var(String),
    /// −x.
    Neg(Box<Node>),
    /// A sum of terms (subtraction is a [`Node::Neg`] term).
    Sum(Vec<Node>),
    /// A product of factors; `true` marks a divisor.
    Prod(Vec<(Node, bool)>),
    /// base ^ exponent.
    Pow(Box<Node>, Box<Node>),
    /// The `n`-th root (`None`: square root).
    Root(Option<Box<Node>>, Box<Node>),
    /// n!.
    Fact(Box<Node>),
    /// (n choose k).
    Binom(Box<Node>, Box<Node>),
    /// A function of one argument.
    Func(Fun, Box<Node>),
    /// log with a base (`\log` alone is base 10, as in math-verify).
    Log(Box<Node>, Box<Node>),
    /// |x|.
    Abs(Box<Node>),
    /// x% (read as x or x/100, see `math_eval`).
    Percent(Box<Node>),
    /// `(a, b, …)`: an ordered tuple (a two-element one is also an open interval).
    Tuple(Vec<Node>),
    /// An interval with at least one closed end: `[a, b]`, `[a, b)`, `(a, b]`.
    Interval {
        /// The lower end.
        lo: Box<Node>,
        /// The upper end.
        hi: Box<Node>,
        /// `[` at the lower end.
        lo_closed: bool,
        /// `]` at the upper end.
        hi_closed: bool,
    },
    /// A set `\{…\}` or a bare comma list.
    Set(Vec<Node>),
    /// A union of intervals / sets.
    Union(Vec<Node>),
    /// A chain of relations: `terms[0] ops[0] terms[1] …`.
    Rel(Vec<Node>, Vec<RelOp>),
    /// A matrix / column vector (rows of cells).
    Matrix(Vec<Vec<Node>>),
    /// Words that are not a unit after a number (`\text{Evelyn}`, `\text{13 apples}`).
    Text(String),
}

/// Relation operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RelOp {
    /// `=`.
    Eq,
    /// `\ne`.
    Ne,
    /// `<`.
    Lt,
    /// `\le`.
    Le,
    /// `>`.
    Gt,
    /// `\ge`.
    Ge,
}

/// Greek letters read as variables (space-separated names).
const GREEK: &str = "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho sigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega";

fn is_greek(name: &str) -> bool {
    GREEK.split(' ').any(|g| g == name)
}

/// Parses a cleaned answer. `None`: not understood (unknown command, unbalanced, too long or deep).
pub fn parse(cleaned: &str) -> Option<Node> {
    if cleaned.chars().count() > MAX_LEN {
        return None;
    }
    let mut toks = Vec::new();
    tokenize(cleaned, &mut toks)?;
    let mut p = Parser { t: toks, i: 0, depth: 0 };
    let node = p.list(&|_| false)?;
    (p.i == p.t.len()).then_some(node)
}

struct Parser {
    t: Vec<T>,
    i: usize,
    depth: usize,
}

impl Parser {
    fn peek(&self) -> Option<&T> {
        self.t.get(self.i)
    }
    fn is(&self, t: &T) -> bool {
        self.peek() == Some(t)
    }
    fn eat(&mut self, t: &T) -> bool {
        let yes = self.is(t);
        if yes {
            self.i += 1;
        }
        yes
    }
    fn enter(&mut self) -> Option<()> {
        self.depth += 1;
        (self.depth <= MAX_DEPTH).then_some(())
    }

    /// `union (',' union)*` up to a token `stop` accepts (not consumed). Several items: a set.
    fn list(&mut self, stop: &dyn Fn(&T) -> bool) -> Option<Node> {
        let mut items = self.list_items(stop)?;
        if items.len() == 1 {
            return items.pop();
        }
        Some(Node::Set(items))
    }

    fn list_items(&mut self, stop: &dyn Fn(&T) -> bool) -> Option<Vec<Node>> {
        self.enter()?;
        let mut items = Vec::new();
        loop {
            if self.peek().is_none_or(stop) {
                break;
            }
            let mut parts = vec![self.rel()?];
            while self.eat(&T::Cmd("cup".into())) {
                parts.push(self.rel()?);
            }
            items.push(if parts.len() == 1 { parts.pop()? } else { Node::Union(parts) });
            if !self.eat(&T::Ch(',')) && !self.eat(&T::Ch(';')) {
                break;
            }
            if self.peek().is_none_or(stop) {
                return None; // a dangling separator
            }
        }
        self.depth -= 1;
        (!items.is_empty()).then_some(items)
    }

    fn rel_op(&self) -> Option<RelOp> {
        Some(match self.peek()? {
            T::Ch('=') => RelOp::Eq,
            T::Ch('<') => RelOp::Lt,
            T::Ch('>') => RelOp::Gt,
            T::Cmd(n) => match n.as_str() {
                "le" | "leq" | "leqslant" => RelOp::Le,
                "ge" | "geq" | "geqslant" => RelOp::Ge,
                "ne" | "neq" => RelOp::Ne,
                "lt" => RelOp::Lt,
                "gt" => RelOp::Gt,
                _ => return None,
            },
            _ => return None,
        })
    }

    fn rel(&mut self) -> Option<Node> {
        let mut terms = vec![self.sum()?];
        let mut ops = Vec::new();
        while let Some(op) = self.rel_op() {
            self.i += 1;
            ops.push(op);
            terms.push(self.sum()?);
        }
        Some(if ops.is_empty() { terms.pop()? } else { Node::Rel(terms, ops) })
    }

    /// Terms joined by `+`, `-`; one `\pm` (or `\mp`) makes the pair of both sums (`1 \pm \sqrt2`).
    fn sum(&mut self) -> Option<Node> {
        let pm = |p: &mut Parser| p.eat(&T::Cmd("pm".into())) || p.eat(&T::Cmd("mp".into()));
        let mut pm_at = None;
        let mut terms = Vec::new();
        if pm(self) {
            pm_at = Some(0);
        }
        terms.push(self.term(false)?);
        loop {
            if self.eat(&T::Ch('+')) {
                terms.push(self.term(false)?);
            } else if self.eat(&T::Ch('-')) {
                terms.push(Node::Neg(Box::new(self.term(false)?)));
            } else if pm_at.is_none() && pm(self) {
                pm_at = Some(terms.len());
                terms.push(self.term(false)?);
            } else {
                break;
            }
        }
        let join = |mut t: Vec<Node>| if t.len() == 1 { t.pop() } else { Some(Node::Sum(t)) };
        match pm_at {
            None => join(terms),
            Some(i) => {
                let mut minus = terms.clone();
                let t = minus.get_mut(i)?;
                *t = Node::Neg(Box::new(t.clone()));
                Some(Node::Set(vec![join(terms)?, join(minus)?]))
            }
        }
    }

    /// Factors joined by `\cdot`, `\times`, `*`, `/`, `\div` or juxtaposition. A function's
    /// unbracketed argument (`func_arg`) takes juxtaposed factors only, and stops at a function.
    fn term(&mut self, func_arg: bool) -> Option<Node> {
        if !func_arg && (self.is(&T::Ch('-')) || self.is(&T::Ch('+'))) {
            // A sign applies to the whole term (`-3\frac12` is -(3 + 1/2)).
            let neg = self.eat(&T::Ch('-'));
            self.eat(&T::Ch('+'));
            self.enter()?;
            let t = self.term(false)?;
            self.depth -= 1;
            return Some(if neg { Node::Neg(Box::new(t)) } else { t });
        }
        let first = self.postfix()?;
        let mut fs: Vec<(Node, bool)> = vec![(first, false)];
        loop {
            let div = !func_arg && (self.eat(&T::Ch('/')) || self.eat(&T::Ch(':')) || self.eat(&T::Cmd("div".into())));
            let explicit = div
                || (!func_arg
                    && (self.eat(&T::Ch('*'))
                        || self.eat(&T::Cmd("cdot".into()))
                        || self.eat(&T::Cmd("times".into()))));
            if explicit {
                fs.push((self.unary()?, div));
                continue;
            }
            if !self.starts_atom(func_arg) {
                break;
            }
            // Two juxtaposed numbers (`3 000`) are not a product anyone means.
            if matches!(fs.last(), Some((Node::Num(_), _))) && matches!(self.peek(), Some(T::Num(_))) {
                return None;
            }
            let whole_int = fs.len() == 1 && is_int(&fs[0].0);
            let f = self.postfix()?;
            // A mixed number: `3\frac{1}{2}` is 3 + 1/2.
            let frac_of_ints = matches!(&f, Node::Prod(ab)
                if ab.len() == 2 && !ab[0].1 && ab[1].1 && ab.iter().all(|(n, _)| is_int(n)));
            if whole_int && frac_of_ints {
                let whole = fs.pop()?.0;
                fs.push((Node::Sum(vec![whole, f]), false));
            } else {
                fs.push((f, false));
            }
        }
        Some(if fs.len() == 1 && !fs[0].1 { fs.pop()?.0 } else { Node::Prod(fs) })
    }

    fn starts_atom(&self, func_arg: bool) -> bool {
        match self.peek() {
            Some(T::Num(_) | T::Let(_) | T::Begin(_)) => true,
            Some(T::Ch(c)) => matches!(c, '(' | '[' | '{'),
            Some(T::Cmd(n)) => {
                let n = n.as_str();
                let func = function_named(n).is_some() || n == "log";
                if func {
                    return !func_arg;
                }
                matches!(n, "frac" | "sqrt" | "binom" | "pi" | "infty") || is_greek(n)
            }
            _ => false,
        }
    }

    fn unary(&mut self) -> Option<Node> {
        self.enter()?;
        let n = if self.eat(&T::Ch('-')) {
            Node::Neg(Box::new(self.unary()?))
        } else if self.eat(&T::Ch('+')) {
            self.unary()?
        } else {
            self.postfix()?
        };
        self.depth -= 1;
        Some(n)
    }

    /// An atom with its postfixes (`^`, `!`, `\%`, at most four) and any unit after it dropped.
    fn postfix(&mut self) -> Option<Node> {
        let mut n = self.atom()?;
        for _ in 0..4 {
            if self.eat(&T::Ch('^')) {
                n = Node::Pow(Box::new(n), Box::new(self.arg()?));
            } else if self.eat(&T::Ch('!')) {
                n = Node::Fact(Box::new(n));
            } else if self.eat(&T::Ch('%')) {
                n = Node::Percent(Box::new(n));
            } else if matches!(self.peek(), Some(T::Text(_))) {
                // A unit after a quantity (`100\text{ cm}`, `8\text{ cm}^2`): dropped.
                self.i += 1;
                if self.eat(&T::Ch('^')) {
                    self.arg()?;
                }
            } else {
                return Some(n);
            }
        }
        (!matches!(self.peek(), Some(T::Ch('^' | '!' | '%') | T::Text(_)))).then_some(n)
    }

    /// A TeX argument: a `{…}` group or one token (`\frac12`: the first digit of `12`).
    fn arg(&mut self) -> Option<Node> {
        match self.peek()? {
            T::Ch('{') => self.atom(),
            T::Num(s) => {
                let s = s.clone();
                let mut ch = s.chars();
                let first = ch.next()?;
                let rest: String = ch.collect();
                if first == '.' {
                    return None;
                }
                if rest.is_empty() {
                    self.i += 1;
                } else if let Some(tok) = self.t.get_mut(self.i) {
                    *tok = T::Num(rest);
                }
                Some(Node::Num(first.to_string()))
            }
            T::Let(_) | T::Cmd(_) => self.atom(),
            _ => None,
        }
    }

    /// Brackets from `open` to `)` or `]`: a group, a tuple or an interval.
    fn bracket(&mut self, open: char) -> Option<Node> {
        let mut items = self.list_items(&|t| matches!(t, T::Ch(')' | ']')))?;
        let close = match self.peek()? {
            T::Ch(c) => *c,
            _ => return None,
        };
        self.i += 1;
        if items.len() == 1 {
            return ((open == '(') == (close == ')')).then(|| items.pop()).flatten();
        }
        if open == '(' && close == ')' {
            return Some(Node::Tuple(items));
        }
        let [lo, hi]: [Node; 2] = items.try_into().ok()?;
        Some(Node::Interval { lo: Box::new(lo), hi: Box::new(hi), lo_closed: open == '[', hi_closed: close == ']' })
    }

    fn atom(&mut self) -> Option<Node> {
        self.enter()?;
        let n = self.atom_inner();
        self.depth -= 1;
        n
    }

    fn atom_inner(&mut self) -> Option<Node> {
        let tok = self.t.get(self.i)?.clone();
        self.i += 1;
        match tok {
            T::Num(s) => Some(Node::Num(s)),
            T::Let('e') => Some(Node::E),
            T::Let(c) => self.var(c.to_string()),
            T::Text(s) => Some(Node::Text(s)),
            T::Ch(open @ ('(' | '[')) => self.bracket(open),
            T::Ch('{') => {
                let n = self.list(&|t| *t == T::Ch('}'))?;
                self.eat(&T::Ch('}')).then_some(n)
            }
            T::Ch('|') => {
                let n = self.sum()?;
                self.eat(&T::Ch('|')).then(|| Node::Abs(Box::new(n)))
            }
            T::Begin(env) => self.matrix(&env),
            T::Cmd(name) => self.command(&name),
            _ => None,
        }
    }

    /// A variable with its subscript (`x_1`, `a_{n}`) and primes.
    fn var(&mut self, mut name: String) -> Option<Node> {
        if self.eat(&T::Ch('_')) {
            let sub = match self.t.get(self.i)?.clone() {
                T::Num(_) => match self.arg()? {
                    Node::Num(d) => d,
                    _ => return None,
                },
                T::Let(c) => {
                    self.i += 1;
                    c.to_string()
                }
                T::Ch('{') => {
                    let mut s = String::new();
                    self.i += 1;
                    loop {
                        match self.t.get(self.i)?.clone() {
                            T::Num(x) => s.push_str(&x),
                            T::Let(c) => s.push(c),
                            T::Ch('}') => break,
                            _ => return None,
                        }
                        self.i += 1;
                    }
                    self.i += 1;
                    s
                }
                _ => return None,
            };
            name = format!("{name}_{sub}");
        }
        while self.eat(&T::Ch('\'')) {
            name.push('\'');
        }
        Some(Node::Var(name))
    }

    fn command(&mut self, name: &str) -> Option<Node> {
        Some(match name {
            "frac" => {
                let (a, b) = (self.arg()?, self.arg()?);
                Node::Prod(vec![(a, false), (b, true)])
            }
            "sqrt" => {
                let index = if self.eat(&T::Ch('[')) {
                    let n = self.sum()?;
                    if !self.eat(&T::Ch(']')) {
                        return None;
                    }
                    Some(Box::new(n))
                } else {
                    None
                };
                Node::Root(index, Box::new(self.arg()?))
            }
            "binom" => Node::Binom(Box::new(self.arg()?), Box::new(self.arg()?)),
            "pi" => Node::Pi,
            "infty" | "infin" => Node::Inf,
            "{" => {
                if self.eat(&T::Cmd("}".into())) {
                    return Some(Node::Set(Vec::new()));
                }
                let items = self.list_items(&|t| *t == T::Cmd("}".into()))?;
                if !self.eat(&T::Cmd("}".into())) {
                    return None;
                }
                Node::Set(items)
            }
            "emptyset" | "varnothing" => Node::Set(Vec::new()),
            "log" | "lg" => {
                let base = if self.eat(&T::Ch('_')) { self.arg()? } else { Node::Num("10".into()) };
                let power = self.fn_power()?;
                let x = self.fn_arg()?;
                wrap_power(Node::Log(Box::new(base), Box::new(x)), power)
            }
            n if is_greek(n) => self.var(format!("\\{n}"))?,
            n => {
                let f = function_named(n)?;
                let power = self.fn_power()?;
                wrap_power(Node::Func(f, Box::new(self.fn_arg()?)), power)
            }
        })
    }

    /// `\sin^2 x`: the power written on a function name.
    fn fn_power(&mut self) -> Option<Option<Node>> {
        if self.eat(&T::Ch('^')) {
            Some(Some(self.arg()?))
        } else {
            Some(None)
        }
    }

    /// A function's argument: a bracketed group, or juxtaposed factors (`\ln 2x`, `\sin\frac{\pi}{6}`).
    fn fn_arg(&mut self) -> Option<Node> {
        self.enter()?;
        let n = if self.is(&T::Ch('(')) { self.atom() } else { self.term(true) };
        self.depth -= 1;
        n
    }

    /// The rows of a matrix environment (`&` between cells, `\\` between rows) up to its `\end`.
    fn matrix(&mut self, env: &str) -> Option<Node> {
        if !matches!(env, "pmatrix" | "bmatrix" | "matrix" | "Bmatrix" | "smallmatrix") {
            return None;
        }
        let end = T::End(env.to_string());
        let mut rows = vec![Vec::new()];
        loop {
            if self.eat(&end) {
                break;
            }
            let stop = |t: &T| matches!(t, T::Ch('&') | T::End(_)) || *t == T::Cmd("\\".into());
            rows.last_mut()?.push(self.list(&stop)?);
            if self.eat(&T::Cmd("\\".into())) {
                if !self.is(&end) {
                    rows.push(Vec::new());
                }
            } else if !self.eat(&T::Ch('&')) && !self.is(&end) {
                return None;
            }
        }
        let width = rows.first()?.len();
        rows.iter().all(|r| r.len() == width).then_some(Node::Matrix(rows))
    }
}

fn wrap_power(n: Node, power: Option<Node>) -> Node {
    match power {
        Some(p) => Node::Pow(Box::new(n), Box::new(p)),
        None => n,
    }
}

/// Whether `n` is an integer literal (no decimal point).
pub fn is_int(n: &Node) -> bool {
    matches!(n, Node::Num(s) if !s.contains('.'))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn num(s: &str) -> Node {
        Node::Num(s.into())
    }

    #[test]
    fn tex_shorthands_take_one_token() {
        assert_eq!(parse("\\frac12"), Some(Node::Prod(vec![(num("1"), false), (num("2"), true)])));
        let x2 = Node::Pow(Box::new(Node::Var("x".into())), Box::new(num("2")));
        assert_eq!(parse("x^23"), Some(Node::Prod(vec![(x2, false), (num("3"), false)])));
        assert!(matches!(parse("3\\frac12"), Some(Node::Sum(_))));
        assert!(matches!(parse("x\\frac12"), Some(Node::Prod(_))));
    }

    #[test]
    fn brackets_make_groups_tuples_and_intervals() {
        assert_eq!(parse("(7)"), Some(num("7")));
        assert_eq!(parse("(1,2)"), Some(Node::Tuple(vec![num("1"), num("2")])));
        assert!(matches!(parse("[0,1)"), Some(Node::Interval { lo_closed: true, hi_closed: false, .. })));
        assert!(matches!(parse("1, 2, 3"), Some(Node::Set(v)) if v.len() == 3));
        assert!(matches!(parse("1 \\pm 2"), Some(Node::Set(v)) if v.len() == 2));
        assert_eq!(parse("[1,2,3)"), None);
        assert_eq!(parse("(7]"), None);
    }

    #[test]
    fn refusals() {
        assert_eq!(parse("3 000"), None); // juxtaposed numbers
        assert_eq!(parse("5,"), None); // dangling separator
        assert_eq!(parse(&format!("{}1{}", "(".repeat(30), ")".repeat(30))), None); // too deep
        assert_eq!(parse(&"1+".repeat(600)), None); // too long
        assert_eq!(parse("\\foo{1}"), None); // unknown command
        assert!(parse(&format!("{}1{}", "(".repeat(10), ")".repeat(10))).is_some());
    }
}
