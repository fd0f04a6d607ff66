//! Answer checking (seed 004 App. B.1; seed 000 App. G: "a rule checks the last boxed answer"):
//! the content of the last `\boxed{...}` against a reference answer, after normalization
//! (whitespace, `\left`/`\right`, `\!`, `\,`, `$`, `\text{}`, `\dfrac`/`\tfrac` → `\frac`,
//! `\frac{a}{b}` ≡ `a/b`, a trailing `.0`, `^\circ`), and numeric equality within 1e-6 when both
//! sides parse as numbers (integers, decimals, fractions, with thousands commas). A response cut at
//! the length limit gets 0 (decided by the caller, which knows the finish reason).

/// The content of the last `\boxed{...}` (or `\fbox{...}`) in `text`, with balanced braces.
pub fn last_boxed(text: &str) -> Option<&str> {
    let (start, _) = ["\\boxed{", "\\fbox{"]
        .iter()
        .filter_map(|p| text.rfind(p).map(|i| (i + p.len(), i)))
        .max_by_key(|(_, i)| *i)?;
    let mut depth = 1usize;
    for (i, ch) in text[start..].char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..start + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// Replaces `\frac{a}{b}` (after `\dfrac`/`\tfrac` are folded) by `(a)/(b)` recursively.
fn fold_fracs(s: &str) -> String {
    let mut out = s.to_string();
    while let Some(i) = out.find("\\frac{") {
        let args_start = i + "\\frac".len();
        let Some((a, after_a)) = braced(&out, args_start) else { break };
        let Some((b, after_b)) = braced(&out, after_a) else { break };
        let rep = format!("({a})/({b})");
        out.replace_range(i..after_b, &rep);
    }
    out
}

/// The content of the `{...}` group starting at byte `at`, and the index after its `}`.
fn braced(s: &str, at: usize) -> Option<(String, usize)> {
    if !s[at..].starts_with('{') {
        return None;
    }
    let mut depth = 0usize;
    for (i, ch) in s[at..].char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some((s[at + 1..at + i].to_string(), at + i + 1));
                }
            }
            _ => {}
        }
    }
    None
}

/// Canonical form of an answer string.
pub fn normalize(s: &str) -> String {
    let mut t = s.trim().to_string();
    for (a, b) in [
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\ ", ""),
        ("$", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("^\\circ", ""),
        ("^{\\circ}", ""),
        ("\\%", ""),
        ("%", ""),
    ] {
        t = t.replace(a, b);
    }
    // \text{...} and \mathrm{...} keep their content.
    for cmd in ["\\text{", "\\mathrm{", "\\textbf{"] {
        while let Some(i) = t.find(cmd) {
            match braced(&t, i + cmd.len() - 1) {
                Some((inner, end)) => t.replace_range(i..end, &inner),
                None => break,
            }
        }
    }
    t.retain(|c| !c.is_whitespace());
    let t = fold_fracs(&t);
    // Bare "(a)/(b)" of plain numbers → "a/b"; drop a trailing ".0…0" of an integer.
    let t = t.replace("(", "").replace(")", "");
    strip_trailing_zero_decimals(&t)
}

fn strip_trailing_zero_decimals(t: &str) -> String {
    if let Some((int, frac)) = t.split_once('.') {
        if !int.is_empty()
            && int.chars().all(|c| c.is_ascii_digit() || c == '-')
            && !frac.is_empty()
            && frac.chars().all(|c| c == '0')
        {
            return int.to_string();
        }
    }
    t.to_string()
}

/// The numeric value of a normalized answer: integers, decimals (thousands commas allowed) and
/// a/b fractions of those.
pub fn numeric(t: &str) -> Option<f64> {
    let num = |x: &str| -> Option<f64> {
        let x = x.trim_start_matches('+');
        let plain = x.replace(',', "");
        if plain.is_empty() || !plain.chars().all(|c| c.is_ascii_digit() || c == '.' || c == '-') {
            return None;
        }
        // Commas must be thousands separators.
        if x.contains(',') && !x.split(',').skip(1).all(|g| g.len() == 3) {
            return None;
        }
        plain.parse::<f64>().ok()
    };
    match t.split_once('/') {
        Some((a, b)) => {
            let (a, b) = (num(a)?, num(b)?);
            (b != 0.0).then(|| a / b)
        }
        None => num(t),
    }
}

/// Whether `answer` matches `reference` after normalization (exactly, or numerically within 1e-6).
pub fn equivalent(answer: &str, reference: &str) -> bool {
    let (a, r) = (normalize(answer), normalize(reference));
    if a == r {
        return true;
    }
    match (numeric(&a), numeric(&r)) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-6 * (1.0 + y.abs()).max(1.0),
        _ => false,
    }
}

/// 1.0 if the response's last boxed answer matches `reference`, else 0.0.
pub fn reward(response: &str, reference: &str) -> f32 {
    match last_boxed(response) {
        Some(a) if equivalent(a, reference) => 1.0,
        _ => 0.0,
    }
}

/// The reward of a rollout with a reference answer: 0 when the response was cut at the length
/// limit (its answer is incomplete, whatever it contains), else [`reward`].
pub fn rollout_reward(truncated: bool, response: &str, reference: &str) -> f32 {
    if truncated {
        0.0
    } else {
        reward(response, reference)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_response_cut_at_the_length_limit_earns_nothing() {
        assert_eq!(rollout_reward(false, "so \\boxed{85}", "85"), 1.0);
        assert_eq!(rollout_reward(true, "so \\boxed{85}", "85"), 0.0);
        assert_eq!(rollout_reward(false, "so \\boxed{84}", "85"), 0.0);
    }

    #[test]
    fn boxed_extraction() {
        assert_eq!(last_boxed("so \\boxed{12} or \\boxed{1{3}}"), Some("1{3}"));
        assert_eq!(last_boxed("\\boxed{85"), None);
        assert_eq!(last_boxed("85"), None);
        assert_eq!(last_boxed("\\boxed{\\frac{1}{2}} then \\fbox{7}"), Some("7"));
    }

    #[test]
    fn a_table_of_real_looking_answers() {
        let same = [
            ("\\boxed{85}", "85"),
            ("The answer is $\\boxed{ 85 }$.", "85"),
            ("\\boxed{85.0}", "85"),
            ("\\boxed{85.000}", "85"),
            ("\\boxed{\\frac{1}{2}}", "1/2"),
            ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
            ("\\boxed{0.5}", "\\frac{1}{2}"),
            ("\\boxed{\\left( 3, 4 \\right)}", "(3,4)"),
            ("\\boxed{10\\%}", "10"),
            ("\\boxed{90^\\circ}", "90"),
            ("\\boxed{\\text{(B)}}", "(B)"),
            ("\\boxed{1,000}", "1000"),
            ("\\boxed{-\\frac{7}{3}}", "-7/3"),
            ("\\boxed{2\\sqrt{3}}", "2 \\sqrt{3}"),
            ("\\boxed{0.3333333}", "1/3"),
        ];
        for (resp, reference) in same {
            assert_eq!(reward(resp, reference), 1.0, "{resp} vs {reference}");
        }
        let different = [
            ("\\boxed{86}", "85"),
            ("85", "85"),
            ("\\boxed{\\frac{1}{3}}", "1/2"),
            ("\\boxed{0.333}", "1/3"),
            ("\\boxed{2\\sqrt{2}}", "2\\sqrt{3}"),
            ("\\boxed{(3,4)}", "(4,3)"),
            ("\\boxed{1,00}", "100"),
            ("\\boxed{}", "0"),
        ];
        for (resp, reference) in different {
            assert_eq!(reward(resp, reference), 0.0, "{resp} vs {reference}");
        }
    }
}
