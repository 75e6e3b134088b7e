//! Stop strings over streamed text: text is released only once it cannot be the start
//! of a stop string, so a stop string never reaches the user, even split across tokens.

/// Watches generated text for stop strings.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    text: String,
    released: usize,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            text: String::new(),
            released: 0,
        }
    }

    /// Adds generated text. Returns the text that may now be shown and whether a stop
    /// string was reached (generation must end; nothing after it is shown).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        let search_from = self
            .released
            .saturating_sub(self.stops.iter().map(String::len).max().unwrap_or(0));
        self.text.push_str(piece);
        let hit = self
            .stops
            .iter()
            .filter_map(|s| {
                let from = floor_char_boundary(&self.text, search_from);
                self.text[from..].find(s.as_str()).map(|i| from + i)
            })
            .min();
        if let Some(at) = hit {
            let out = self.text[self.released..at.max(self.released)].to_string();
            self.released = self.text.len();
            return (out, true);
        }
        // Hold back the longest tail that is a prefix of some stop string.
        let mut hold = 0;
        for s in &self.stops {
            for len in (1..s.len().min(self.text.len() - self.released + 1)).rev() {
                if self.text.is_char_boundary(self.text.len() - len)
                    && s.is_char_boundary(len)
                    && self.text.ends_with(&s[..len])
                {
                    hold = hold.max(len);
                    break;
                }
            }
        }
        let end = self.text.len() - hold;
        let out = self.text[self.released..end].to_string();
        self.released = end;
        (out, false)
    }

    /// Text held back at the end of generation (it did not become a stop string).
    pub fn flush(&mut self) -> String {
        let out = self.text[self.released..].to_string();
        self.released = self.text.len();
        out
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while i > 0 && !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (text, stop) = m.push(p);
            out.push_str(&text);
            if stop {
                return (out, true);
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn no_stop_strings_passes_everything() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
    }

    #[test]
    fn stop_string_split_across_pieces_is_never_shown() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D more"]),
            ("hello ".into(), true)
        );
    }

    #[test]
    fn held_back_text_is_released_when_it_does_not_match() {
        assert_eq!(run(&["END"], &["x E", "Nx"]), ("x ENx".into(), false));
    }

    #[test]
    fn earliest_of_several_stop_strings_wins() {
        assert_eq!(run(&["b", "a"], &["xxab"]), ("xx".into(), true));
    }

    #[test]
    fn multibyte_text_is_handled() {
        assert_eq!(run(&["é!"], &["café", "é", "!"]), ("café".into(), true));
    }
}
