//! The tokenizer of the answer rule's LaTeX parser (seed 004 App. B.1 / seed 000 App. G: "a rule
//! checks the last boxed answer"; the readings follow math-verify 0.8.0 / latex2sympy).
//!
//! Owns: splitting a cleaned answer into [`Tok`]s: numbers with thousands commas (`1,000`, a 1–3
//! digit lead and groups of exactly three digits) and decimals, letters, commands, `\text{…}`-like
//! groups (words become a [`Tok::Text`] — a unit or a name; a lone choice letter, `(A)` or math
//! inside is tokenized in braces; `or`/`and` become a comma), `\begin`/`\end` environments; and
//! the names of the functions of one argument ([`Fun`]).
//! May call: `super::math_norm`. Must not: parse structure (that is `math_expr`).

use super::math_norm::group_end;

/// Deepest nesting of text commands (`\text{\text{…}}`) the tokenizer accepts.
const MAX_TEXT_DEPTH: usize = 40;

/// A token of a cleaned answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Tok {
    /// A number without thousands commas (`1,000` → `1000`; `0.50`, `017` kept as written).
    Num(String),
    /// One ASCII letter.
    Let(char),
    /// `\name`, or `\{`, `\}`, `\\` (name `{`, `}`, `\`).
    Cmd(String),
    /// One of `+-*/^_()[]{},=<>!|'&%:;`.
    Ch(char),
    /// Words from a text command (`\text{ cm}` → `cm`).
    Text(String),
    /// `\begin{env}`.
    Begin(String),
    /// `\end{env}`.
    End(String),
}

/// Functions of one argument, by their command names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fun {
    /// `\\sin`: sine.
    Sin,
    /// `\\cos`: cosine.
    Cos,
    /// `\\tan`: tangent.
    Tan,
    /// `\\cot`: cotangent.
    Cot,
    /// `\\sec`: secant.
    Sec,
    /// `\\csc`: cosecant.
    Csc,
    /// `\\arcsin`: arcsine.
    Asin,
    /// `\\arccos`: arccosine.
    Acos,
    /// `\\arctan`: arctangent.
    Atan,
    /// `\\sinh`: hyperbolic sine.
    Sinh,
    /// `\\cosh`: hyperbolic cosine.
    Cosh,
    /// `\\tanh`: hyperbolic tangent.
    Tanh,
    /// `\\ln`: natural logarithm.
    Ln,
    /// `\\exp`: exponential.
    Exp,
}

/// The function a command names (`sin` → [`Fun::Sin`]), if any.
pub fn function_named(name: &str) -> Option<Fun> {
    Some(match name {
        "sin" => Fun::Sin,
        "cos" => Fun::Cos,
        "tan" => Fun::Tan,
        "cot" => Fun::Cot,
        "sec" => Fun::Sec,
        "csc" => Fun::Csc,
        "arcsin" => Fun::Asin,
        "arccos" => Fun::Acos,
        "arctan" => Fun::Atan,
        "sinh" => Fun::Sinh,
        "cosh" => Fun::Cosh,
        "tanh" => Fun::Tanh,
        "ln" => Fun::Ln,
        "exp" => Fun::Exp,
        _ => return None,
    })
}

/// Commands whose argument is words (`\text{…}`): units, names, or wrapped math (space-separated).
const TEXT_CMDS: &str = "text textbf textit textrm textsf texttt mbox hbox mathrm mathsf mathtt operatorname";
/// Commands whose argument is kept as math (`\mathbf{v}` is `v`).
const STYLE_CMDS: &str = "mathbf boldsymbol bm mathit mathnormal mathbb mathcal";
/// Appends the tokens of `s` to `out`; `None` on a character or command group it cannot read.
pub fn tokenize(s: &str, out: &mut Vec<Tok>) -> Option<()> {
    tokenize_at(s, 0, out)
}

fn tokenize_at(s: &str, depth: usize, out: &mut Vec<Tok>) -> Option<()> {
    if depth > MAX_TEXT_DEPTH {
        return None;
    }
    let c: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
            continue;
        }
        let tok = if ch.is_ascii_digit() || (ch == '.' && c.get(i + 1).is_some_and(|d| d.is_ascii_digit())) {
            let (num, next) = read_number(&c, i);
            i = next;
            Tok::Num(num)
        } else if ch.is_ascii_alphabetic() {
            i += 1;
            Tok::Let(ch)
        } else if ch == '\\' {
            let start = i + 1;
            let mut j = start;
            while j < c.len() && c[j].is_ascii_alphabetic() {
                j += 1;
            }
            if j == start {
                // `\{`, `\}`, `\\`, `\%`, `\|`, …: one non-letter character.
                let sym = *c.get(start)?;
                i = start + 1;
                match sym {
                    '%' => Tok::Ch('%'),
                    '|' => Tok::Ch('|'),
                    _ => Tok::Cmd(sym.to_string()),
                }
            } else {
                let name: String = c[start..j].iter().collect();
                i = j;
                let is_text = TEXT_CMDS.split(' ').any(|c| c == name);
                if is_text || STYLE_CMDS.split(' ').any(|c| c == name) || name == "begin" || name == "end" {
                    let rest: String = c[i..].iter().collect();
                    let rest_trim = rest.trim_start();
                    let skipped = rest.chars().count() - rest_trim.chars().count();
                    let end = group_end(rest_trim, 0)?;
                    let inner = &rest_trim[1..end - 1];
                    i += skipped + rest_trim[..end].chars().count();
                    if name == "begin" || name == "end" {
                        let env = inner.trim().to_string();
                        out.push(if name == "begin" { Tok::Begin(env) } else { Tok::End(env) });
                    } else if is_text && (is_words(inner) || is_unit_letter(inner, out.last())) {
                        let words = inner.split_whitespace().collect::<Vec<_>>().join(" ");
                        // `x = 2 \text{ or } x = 3` lists two answers.
                        let tok = if words == "or" || words == "and" { Tok::Ch(',') } else { Tok::Text(words) };
                        out.push(tok);
                    } else {
                        out.push(Tok::Ch('{'));
                        tokenize_at(inner, depth + 1, out)?;
                        out.push(Tok::Ch('}'));
                    }
                    continue;
                }
                Tok::Cmd(name)
            }
        } else if "+-*/^_()[]{},=<>!|'&%:;".contains(ch) {
            i += 1;
            Tok::Ch(ch)
        } else {
            return None;
        };
        out.push(tok);
    }
    Some(())
}

/// Whether `\text{inner}` holds words (a unit or a name) rather than math: it has a letter and is
/// not a lone choice letter (`A`, `(A)`), `e` or `i`.
fn is_words(inner: &str) -> bool {
    let t = inner.trim();
    let b = t.as_bytes();
    let choice = match b {
        [x] => x.is_ascii_uppercase() || *x == b'e' || *x == b'i',
        [b'(', x, b')'] => x.is_ascii_uppercase(),
        _ => false,
    };
    !choice && t.chars().any(|ch| ch.is_alphabetic())
}

/// `5\mathrm{m}`: one letter in a text command right after a number is a unit, not a choice.
fn is_unit_letter(inner: &str, prev: Option<&Tok>) -> bool {
    let t = inner.trim();
    t.len() == 1 && t.chars().all(|c| c.is_ascii_alphabetic()) && matches!(prev, Some(Tok::Num(_)))
}

/// A number starting at `c[i]`: digits, thousands groups (`1,000`, only after a 1–3 digit lead and
/// when exactly three digits follow each comma), an optional decimal part. Returns it without commas.
fn read_number(c: &[char], mut i: usize) -> (String, usize) {
    let mut s = String::new();
    let digits = |i: &mut usize, s: &mut String| {
        while *i < c.len() && c[*i].is_ascii_digit() {
            s.push(c[*i]);
            *i += 1;
        }
    };
    digits(&mut i, &mut s);
    if (1..=3).contains(&s.len()) {
        loop {
            let group = c.get(i + 1..i + 4);
            let is_group = c.get(i) == Some(&',')
                && group.is_some_and(|g| g.iter().all(|d| d.is_ascii_digit()))
                && !c.get(i + 4).is_some_and(|d| d.is_ascii_digit());
            if !is_group {
                break;
            }
            s.extend(&c[i + 1..i + 4]);
            i += 4;
        }
    }
    if c.get(i) == Some(&'.') && c.get(i + 1).is_some_and(|d| d.is_ascii_digit()) {
        s.push('.');
        i += 1;
        digits(&mut i, &mut s);
    }
    (s, i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use Tok::*;

    fn toks(s: &str) -> Option<Vec<Tok>> {
        let mut out = Vec::new();
        tokenize(s, &mut out)?;
        Some(out)
    }

    #[test]
    fn numbers_keep_thousands_groups_only() {
        assert_eq!(toks("1,000,000.5"), Some(vec![Num("1000000.5".into())]));
        assert_eq!(toks("1,00"), Some(vec![Num("1".into()), Ch(','), Num("00".into())]));
        assert_eq!(toks("1,0000"), Some(vec![Num("1".into()), Ch(','), Num("0000".into())]));
        assert_eq!(toks("1, 000"), Some(vec![Num("1".into()), Ch(','), Num("000".into())]));
        assert_eq!(toks(".5x"), Some(vec![Num(".5".into()), Let('x')]));
    }

    #[test]
    fn text_is_a_unit_a_word_or_math() {
        assert_eq!(toks("4\\text{ cm}"), Some(vec![Num("4".into()), Text("cm".into())]));
        assert_eq!(toks("5\\mathrm{m}"), Some(vec![Num("5".into()), Text("m".into())]));
        assert_eq!(toks("\\text{(B)}"), Some(vec![Ch('{'), Ch('('), Let('B'), Ch(')'), Ch('}')]));
        assert_eq!(toks("\\text{ or }"), Some(vec![Ch(',')]));
        assert_eq!(toks("\\text{13 apples}"), Some(vec![Text("13 apples".into())]));
        assert_eq!(toks("\\begin{pmatrix}"), Some(vec![Begin("pmatrix".into())]));
        assert_eq!(toks("\\text{open"), None);
        assert_eq!(toks("é"), None);
    }
}
