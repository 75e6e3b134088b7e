//! The step protocol: rank 0's decisions, broadcast to every rank.
//!
//! Encoding: a tag byte, then little-endian fields. A step that does not decode is an
//! error on the receiving rank (never a guess).

/// Which logits rank 0 wants from a forward step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None: a prefill chunk before the last one; the head is not computed at all.
    None,
    /// The last new position's.
    Last,
    /// Every new position's.
    All,
}

impl Logits {
    fn byte(self) -> u8 {
        match self {
            Self::Last => 0,
            Self::All => 1,
            Self::None => 2,
        }
    }
}

/// One sequence's share of a batched step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    pub seq: u64,
    pub tokens: Vec<u32>,
    pub logits: Logits,
    /// Positions the sequence will reach (prompt and answer): ranks size its cache once.
    pub reserve: u32,
}

/// What every rank does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Append `tokens` to sequence `seq` (created empty if new), with the `logits` rank 0
    /// wants.
    Forward {
        seq: u64,
        tokens: Vec<u32>,
        logits: Logits,
    },
    /// Append each part's tokens to its sequence in one forward pass (continuous
    /// batching: decode tokens of many sequences and a slice of a prompt together). The
    /// logits come back as the wanted rows of every part, in part order.
    Batch { parts: Vec<Part> },
    /// Start sequence `to` with a copy of the first `len` positions of `from` (a shared
    /// prompt prefix).
    Fork { from: u64, to: u64, len: u32 },
    /// Empty sequence `seq`.
    Reset { seq: u64 },
    /// Forget sequence `seq` and free its cache.
    Release { seq: u64 },
    /// Leave the rank loop.
    Shutdown,
}

const FORWARD: u8 = 1;
const RESET: u8 = 2;
const SHUTDOWN: u8 = 3;
const RELEASE: u8 = 4;
const BATCH: u8 = 5;
const FORK: u8 = 6;

fn seq_at(b: &[u8], at: usize) -> Result<u64, String> {
    b.get(at..at + 8)
        .and_then(|s| s.try_into().ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| format!("step of {} bytes has no sequence id", b.len()))
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, String> {
    b.get(at..at + 4)
        .and_then(|s| s.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| format!("step of {} bytes ends inside a count", b.len()))
}

fn logits_of(byte: u8) -> Result<Logits, String> {
    match byte {
        0 => Ok(Logits::Last),
        1 => Ok(Logits::All),
        2 => Ok(Logits::None),
        v => Err(format!("forward step with logits flag {v}")),
    }
}

impl Step {
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Self::Batch { parts } => {
                let tokens: usize = parts.iter().map(|p| p.tokens.len()).sum();
                let mut b = Vec::with_capacity(5 + 17 * parts.len() + 4 * tokens);
                b.push(BATCH);
                b.extend_from_slice(&(parts.len() as u32).to_le_bytes());
                for p in parts {
                    b.push(p.logits.byte());
                    b.extend_from_slice(&p.seq.to_le_bytes());
                    b.extend_from_slice(&p.reserve.to_le_bytes());
                    b.extend_from_slice(&(p.tokens.len() as u32).to_le_bytes());
                    for t in &p.tokens {
                        b.extend_from_slice(&t.to_le_bytes());
                    }
                }
                b
            }
            Self::Forward {
                seq,
                tokens,
                logits,
            } => {
                let mut b = Vec::with_capacity(14 + 4 * tokens.len());
                b.push(FORWARD);
                b.push(logits.byte());
                b.extend_from_slice(&seq.to_le_bytes());
                b.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
                for t in tokens {
                    b.extend_from_slice(&t.to_le_bytes());
                }
                b
            }
            Self::Fork { from, to, len } => [
                &[FORK][..],
                &from.to_le_bytes(),
                &to.to_le_bytes(),
                &len.to_le_bytes(),
            ]
            .concat(),
            Self::Reset { seq } => [&[RESET][..], &seq.to_le_bytes()].concat(),
            Self::Release { seq } => [&[RELEASE][..], &seq.to_le_bytes()].concat(),
            Self::Shutdown => vec![SHUTDOWN],
        }
    }

    pub fn decode(b: &[u8]) -> Result<Self, String> {
        match b.first() {
            Some(&BATCH) => {
                let count = u32_at(b, 1)? as usize;
                let mut at = 5;
                let mut parts = Vec::with_capacity(count.min(4096));
                for _ in 0..count {
                    let logits = logits_of(*b.get(at).ok_or("a batch step ends early")?)?;
                    let seq = seq_at(b, at + 1)?;
                    let reserve = u32_at(b, at + 9)?;
                    let n = u32_at(b, at + 13)? as usize;
                    at += 17;
                    let end = n
                        .checked_mul(4)
                        .and_then(|len| at.checked_add(len))
                        .filter(|&end| end <= b.len())
                        .ok_or_else(|| format!("batch step of {} bytes for {n} tokens", b.len()))?;
                    let tokens = b[at..end]
                        .chunks_exact(4)
                        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect();
                    at = end;
                    parts.push(Part {
                        seq,
                        tokens,
                        logits,
                        reserve,
                    });
                }
                if at != b.len() {
                    return Err(format!("batch step with {} bytes left over", b.len() - at));
                }
                Ok(Self::Batch { parts })
            }
            Some(&FORWARD) => {
                if b.len() < 14 {
                    return Err(format!("forward step of {} bytes", b.len()));
                }
                let logits = logits_of(b[1])?;
                let seq = seq_at(b, 2)?;
                let n = u32::from_le_bytes([b[10], b[11], b[12], b[13]]) as usize;
                if b.len() != 14 + 4 * n {
                    return Err(format!("forward step of {} bytes for {n} tokens", b.len()));
                }
                let tokens = b[14..]
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                Ok(Self::Forward {
                    seq,
                    tokens,
                    logits,
                })
            }
            Some(&FORK) if b.len() == 21 => Ok(Self::Fork {
                from: seq_at(b, 1)?,
                to: seq_at(b, 9)?,
                len: u32_at(b, 17)?,
            }),
            Some(&RESET) if b.len() == 9 => Ok(Self::Reset { seq: seq_at(b, 1)? }),
            Some(&RELEASE) if b.len() == 9 => Ok(Self::Release { seq: seq_at(b, 1)? }),
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
                seq: 7,
                tokens: vec![1, 2, 70_000],
                logits: Logits::All,
            },
            Step::Forward {
                seq: u64::MAX,
                tokens: vec![],
                logits: Logits::Last,
            },
            Step::Forward {
                seq: 2,
                tokens: vec![9; 64],
                logits: Logits::None,
            },
            Step::Reset { seq: 3 },
            Step::Release { seq: 4 },
            Step::Shutdown,
            Step::Fork {
                from: 1,
                to: 2,
                len: 2000,
            },
            Step::Batch { parts: vec![] },
            Step::Batch {
                parts: vec![
                    Part {
                        seq: 1,
                        tokens: vec![4],
                        logits: Logits::Last,
                        reserve: 100,
                    },
                    Part {
                        seq: 9,
                        tokens: vec![1, 2, 3],
                        logits: Logits::None,
                        reserve: 0,
                    },
                ],
            },
        ] {
            assert_eq!(Step::decode(&s.encode()), Ok(s));
        }
        assert!(Step::decode(&[]).is_err());
        assert!(Step::decode(&[9]).is_err());
        let mut truncated = Step::Forward {
            seq: 1,
            tokens: vec![5],
            logits: Logits::Last,
        }
        .encode();
        truncated.pop();
        assert!(Step::decode(&truncated).is_err());
        let mut flag = truncated.clone();
        flag[1] = 7;
        assert!(Step::decode(&flag).is_err());
        assert!(Step::decode(&[2, 0]).is_err());
        // A batch that claims more parts or tokens than it carries.
        let mut batch = Step::Batch {
            parts: vec![Part {
                seq: 1,
                tokens: vec![4, 5],
                logits: Logits::All,
                reserve: 7,
            }],
        }
        .encode();
        assert!(Step::decode(&batch[..batch.len() - 1]).is_err());
        batch[1] = 2;
        assert!(Step::decode(&batch).is_err());
        let mut huge = vec![BATCH, 1, 0, 0, 0, 0];
        huge.extend_from_slice(&7u64.to_le_bytes());
        huge.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Step::decode(&huge).is_err());
        assert!(Step::decode(&[3, 0]).is_err());
    }
}
