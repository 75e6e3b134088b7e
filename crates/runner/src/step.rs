//! The step protocol: rank 0's decisions, broadcast to every rank.
//!
//! Encoding: a tag byte, then little-endian fields. A step that does not decode is an
//! error on the receiving rank (never a guess).

/// What every rank does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Append `tokens` to the sequence; rank 0 wants logits for every new position
    /// (`all_logits`) or only the last.
    Forward { tokens: Vec<u32>, all_logits: bool },
    /// Empty the sequence.
    Reset,
    /// Leave the rank loop.
    Shutdown,
}

const FORWARD: u8 = 1;
const RESET: u8 = 2;
const SHUTDOWN: u8 = 3;

impl Step {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Self::Forward { tokens, all_logits } => {
                let mut b = Vec::with_capacity(6 + 4 * tokens.len());
                b.push(FORWARD);
                b.push(*all_logits as u8);
                b.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
                for t in tokens {
                    b.extend_from_slice(&t.to_le_bytes());
                }
                b
            }
            Self::Reset => vec![RESET],
            Self::Shutdown => vec![SHUTDOWN],
        }
    }

    pub fn decode(b: &[u8]) -> Result<Self, String> {
        match b.first() {
            Some(&FORWARD) => {
                if b.len() < 6 {
                    return Err(format!("forward step of {} bytes", b.len()));
                }
                let all_logits = match b[1] {
                    0 => false,
                    1 => true,
                    v => return Err(format!("forward step with logits flag {v}")),
                };
                let n = u32::from_le_bytes([b[2], b[3], b[4], b[5]]) as usize;
                if b.len() != 6 + 4 * n {
                    return Err(format!("forward step of {} bytes for {n} tokens", b.len()));
                }
                let tokens = b[6..]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                Ok(Self::Forward { tokens, all_logits })
            }
            Some(&RESET) if b.len() == 1 => Ok(Self::Reset),
            Some(&SHUTDOWN) if b.len() == 1 => Ok(Self::Shutdown),
            Some(t) => Err(format!("unknown step tag {t} ({} bytes)", b.len())),
            None => Err("empty step".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steps_round_trip_and_garbage_is_refused() {
        for s in [
            Step::Forward {
                tokens: vec![1, 2, 70_000],
                all_logits: true,
            },
            Step::Forward {
                tokens: vec![],
                all_logits: false,
            },
            Step::Reset,
            Step::Shutdown,
        ] {
            assert_eq!(Step::decode(&s.encode()), Ok(s));
        }
        assert!(Step::decode(&[]).is_err());
        assert!(Step::decode(&[9]).is_err());
        assert!(Step::decode(&[1, 0, 5, 0, 0, 0, 1]).is_err());
        assert!(Step::decode(&[1, 7, 0, 0, 0, 0]).is_err());
        assert!(Step::decode(&[2, 0]).is_err());
    }
}
