//! Answer checking: the last `\boxed{...}` of a response against a reference answer.
//! (The normalization rules grow with the RL objectives.)

/// The content of the last `\boxed{...}` in `text`, with balanced braces.
pub fn last_boxed(text: &str) -> Option<&str> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
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

/// Normalizes an answer for comparison: whitespace removed.
pub fn normalize(s: &str) -> String {
    s.chars().filter(|c| !c.is_whitespace()).collect()
}

/// 1.0 if the response's last boxed answer equals `reference` (after normalization), else 0.0.
pub fn reward(response: &str, reference: &str) -> f32 {
    match last_boxed(response) {
        Some(a) if normalize(a) == normalize(reference) => 1.0,
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxed_extraction() {
        assert_eq!(last_boxed("so \\boxed{12} or \\boxed{1{3}}"), Some("1{3}"));
        assert_eq!(last_boxed("\\boxed{85"), None);
        assert_eq!(last_boxed("85"), None);
        assert_eq!(reward("\\boxed{ 85 }", "85"), 1.0);
        assert_eq!(reward("\\boxed{86}", "85"), 0.0);
    }
}
