//! String normalization of a LaTeX answer before it is parsed (part of the answer rule of seed 004
//! App. B.1 / seed 000 App. G, "a rule checks the last boxed answer"; which spellings are the same
//! follows math-verify 0.8.0, the checker TRL / verl use).
//!
//! Owns: [`clean`] (drops `$`, `\$`, `\left`/`\right`, spacing commands, degree signs, a final
//! period and trailing bare unit words; folds `\dfrac`/`\tfrac`, `{,}`, a few Unicode symbols)
//! and [`key`] (the string two answers are compared by before any parsing).
//! May call: nothing outside this file. Must not: parse expressions or decide equivalence.

/// Replacements applied in order by [`clean`]: (from, to). Plain substring replacements; the
/// command names below never prefix a longer command that an answer could contain.
const REPLACE: &[(&str, &str)] = &[
    ("\\$", ""),
    ("$", ""),
    ("{,}", ","),
    ("\\qquad", " "),
    ("\\quad", " "),
    ("~", " "),
    ("\\displaystyle", ""),
    ("\\textstyle", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\circ", ""),
    ("\\degree", ""),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("\\cfrac", "\\frac"),
    ("\\dbinom", "\\binom"),
    ("\\tbinom", "\\binom"),
    ("\\mathbb{R}", "(-\\infty,\\infty)"),
    ("\\mathbb R", "(-\\infty,\\infty)"),
    ("\\lbrace", "\\{"),
    ("\\rbrace", "\\}"),
    ("\\langle", "("),
    ("\\rangle", ")"),
    ("\\lvert", "|"),
    ("\\rvert", "|"),
    ("\\vert", "|"),
    ("\u{2212}", "-"),
    ("\u{00d7}", "\\times "),
    ("\u{00b7}", "\\cdot "),
    ("\u{03c0}", "\\pi "),
    ("\u{221e}", "\\infty "),
    ("\u{2264}", "\\le "),
    ("\u{2265}", "\\ge "),
    ("\u{00b0}", ""),
];

/// Replaces the spacing commands `\,` `\;` `\:` `\ ` by a space and drops `\!`, leaving `\\`
/// (a row break) alone.
fn spacing(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut it = s.chars().peekable();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.peek() {
            Some(',' | ';' | ':' | ' ') => {
                it.next();
                out.push(' ');
            }
            Some('!') => {
                it.next();
            }
            Some('\\') => {
                it.next();
                out.push_str("\\\\");
            }
            _ => out.push(c),
        }
    }
    out
}

/// Removes every `\name` not followed by an ASCII letter (so `\left` goes but `\leftarrow` stays).
fn remove_cmd(s: &str, name: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find(name) {
        let after = &rest[i + name.len()..];
        out.push_str(&rest[..i]);
        if after.starts_with(|c: char| c.is_ascii_alphabetic()) {
            out.push_str(name);
        }
        rest = after;
    }
    out.push_str(rest);
    out
}

/// Drops trailing bare unit words after a number (`5 hours`, `12 square feet` → `5`, `12`),
/// as math-verify does: only words of two or more ASCII letters, separated from a digit by space,
/// and none a bare function name (`3 pi` stays).
fn strip_bare_units(s: &str) -> &str {
    let t = s.trim_end();
    let start = t.trim_end_matches(|c: char| c.is_ascii_alphabetic() || c == ' ').len();
    let (head, tail) = t.split_at(start);
    if tail.is_empty() || !tail.starts_with(' ') || !head.ends_with(|c: char| c.is_ascii_digit()) {
        return t;
    }
    let math_word = |w: &str| ["pi", "sqrt", "sin", "cos", "tan", "log", "ln", "exp", "mod"].contains(&w);
    if tail.split_whitespace().all(|w| w.len() >= 2 && !math_word(w)) {
        head
    } else {
        t
    }
}

/// The cleaned LaTeX of an answer: see the module comment. Never fails; the result may be empty.
pub fn clean(s: &str) -> String {
    let mut t = s.trim().to_string();
    for name in ["\\left", "\\right", "\\bigl", "\\bigr", "\\Bigl", "\\Bigr", "\\big", "\\Big"] {
        t = remove_cmd(&t, name);
    }
    t = spacing(&t);
    for (a, b) in REPLACE {
        if t.contains(a) {
            t = t.replace(a, b);
        }
    }
    let mut t = t.trim().trim_end_matches(['.', ' ']).trim().to_string();
    let kept = strip_bare_units(&t).len();
    t.truncate(kept);
    t
}

/// The string two cleaned answers are compared by before parsing: `\text{…}`-like wrappers
/// unwrapped and whitespace removed, except one space between two digits (so `3\,000` is not
/// `3000`, as in math-verify).
pub fn key(cleaned: &str) -> String {
    let mut t = cleaned.to_string();
    for cmd in ["\\text{", "\\textbf{", "\\mathrm{", "\\mbox{", "\\textrm{", "\\mathbf{"] {
        let mut from = 0;
        while let Some(off) = t.get(from..).and_then(|r| r.find(cmd)) {
            let i = from + off;
            match group_end(&t, i + cmd.len() - 1) {
                Some(end) => {
                    let inner = t[i + cmd.len()..end - 1].to_string();
                    t.replace_range(i..end, &inner);
                    from = i;
                }
                None => break,
            }
        }
    }
    let chars: Vec<char> = t.chars().collect();
    let mut out = String::with_capacity(t.len());
    let mut i = 0;
    while i < chars.len() {
        if !chars[i].is_whitespace() {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        while i < chars.len() && chars[i].is_whitespace() {
            i += 1;
        }
        if out.ends_with(|d: char| d.is_ascii_digit()) && chars.get(i).is_some_and(|d| d.is_ascii_digit()) {
            out.push(' ');
        }
    }
    out
}

/// The byte index just after the `}` that closes the `{` at byte `open` of `s`, if balanced.
pub fn group_end(s: &str, open: usize) -> Option<usize> {
    if !s.get(open..)?.starts_with('{') {
        return None;
    }
    let mut depth = 0usize;
    for (i, ch) in s[open..].char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cleaning_drops_decoration_and_keeps_meaning() {
        assert_eq!(clean(" $\\left( 3, 4 \\right)$. "), "( 3, 4 )");
        assert_eq!(clean("\\$32,\\!348"), "32,348");
        assert_eq!(clean("1{,}000"), "1,000");
        assert_eq!(clean("90^\\circ"), "90");
        assert_eq!(clean("\\dfrac34"), "\\frac34");
        assert_eq!(clean("5 hours"), "5");
        assert_eq!(clean("12 square feet"), "12");
        assert_eq!(clean("2 x"), "2 x");
        assert_eq!(clean("3 pi"), "3 pi");
        assert_eq!(clean("2 \\pi"), "2 \\pi");
        assert_eq!(clean("\\leftarrow"), "\\leftarrow");
        assert_eq!(clean(""), "");
    }

    #[test]
    fn keys_unwrap_text_and_keep_digit_gaps() {
        assert_eq!(key(&clean("\\text{Evelyn}")), "Evelyn");
        assert_eq!(key(&clean("\\textbf{(B)}")), "(B)");
        assert_eq!(key(&clean("3\\,000")), "3 000");
        assert_eq!(key(&clean("2 \\sqrt{3}")), "2\\sqrt{3}");
        assert_eq!(key(&clean("\\text{unbalanced")), "\\text{unbalanced");
    }
}
