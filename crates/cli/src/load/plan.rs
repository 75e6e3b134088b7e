//! What each load client sends: a fixed mix of request kinds (short questions, long
//! prompts, questions after a shared long prefix, answers the client cancels midway or
//! walks away from before the first token), chosen by a seeded hash of the client and
//! request number so that a run can be repeated exactly.

use super::protocol::Api;

/// A kind of request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    Short,
    /// A prompt of about [`LONG_WORDS`] words.
    Long,
    /// A question after a long system prompt every such request shares (agent clients
    /// resend theirs): the prefix cache's case.
    SharedPrefix,
    /// Read a few pieces, then close the connection.
    CancelMidway,
    /// Close the connection as soon as the answer starts.
    Disconnect,
}

/// One request of a client.
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    pub kind: Kind,
    pub api: Api,
    pub messages: Vec<(&'static str, String)>,
    pub max_tokens: usize,
    /// Text pieces to read before closing (cancelling kinds only).
    pub cancel_after: Option<usize>,
}

pub const LONG_WORDS: usize = 700;

const QUESTIONS: [&str; 8] = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Explain a hash map in two sentences.",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Give me a tip for learning Rust.",
    "Why is the sky blue?",
    "Say hi.",
];

/// splitmix64: a good spread from consecutive inputs.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn shared_prefix() -> String {
    let rules = "You are a careful assistant for a team of engineers. Answer briefly, \
                 name your assumptions, and prefer plain words. ";
    rules.repeat(12)
}

/// Request `n` of client `client`.
pub fn planned(seed: u64, client: usize, n: usize, apis: &[Api]) -> Planned {
    let h = mix(seed ^ mix(client as u64) ^ mix(n as u64).rotate_left(17));
    let kind = match h % 100 {
        0..40 => Kind::Short,
        40..55 => Kind::Long,
        55..80 => Kind::SharedPrefix,
        80..92 => Kind::CancelMidway,
        _ => Kind::Disconnect,
    };
    let api = apis[(h >> 8) as usize % apis.len().max(1)];
    let question = QUESTIONS[(h >> 16) as usize % QUESTIONS.len()].to_string();
    let (messages, max_tokens, cancel_after) = match kind {
        Kind::Short => (vec![("user", question)], 48, None),
        Kind::Long => {
            let words = "the lighthouse keeper counted ships at night and wrote each down ";
            let text = words.repeat(LONG_WORDS / 11);
            (
                vec![("user", format!("{text}\nSummarise that in one line."))],
                24,
                None,
            )
        }
        Kind::SharedPrefix => (
            vec![("system", shared_prefix()), ("user", question)],
            32,
            None,
        ),
        Kind::CancelMidway => (
            vec![("user", "Tell me a long story about a lighthouse.".into())],
            400,
            Some(3 + (h >> 24) as usize % 8),
        ),
        Kind::Disconnect => (
            vec![("user", "Write a long essay about the sea.".into())],
            400,
            Some(0),
        ),
    };
    Planned {
        kind,
        api,
        messages,
        max_tokens,
        cancel_after,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn the_same_seed_plans_the_same_requests() {
        let a: Vec<Planned> = (0..50).map(|n| planned(7, 3, n, &Api::ALL)).collect();
        let b: Vec<Planned> = (0..50).map(|n| planned(7, 3, n, &Api::ALL)).collect();
        assert_eq!(a, b);
        let c: Vec<Planned> = (0..50).map(|n| planned(8, 3, n, &Api::ALL)).collect();
        assert_ne!(a, c);
    }

    #[test]
    fn every_kind_and_api_comes_up_in_about_its_share() {
        let mut kinds = BTreeMap::new();
        let mut apis = BTreeMap::new();
        for client in 0..6 {
            for n in 0..200 {
                let p = planned(1, client, n, &Api::ALL);
                *kinds.entry(p.kind).or_insert(0) += 1;
                *apis.entry(format!("{:?}", p.api)).or_insert(0) += 1;
                assert_eq!(
                    p.cancel_after.is_some(),
                    matches!(p.kind, Kind::CancelMidway | Kind::Disconnect)
                );
            }
        }
        let share = |k| kinds[&k] as f64 / 1200.0;
        assert!((share(Kind::Short) - 0.40).abs() < 0.06, "{kinds:?}");
        assert!((share(Kind::Disconnect) - 0.08).abs() < 0.04, "{kinds:?}");
        assert_eq!(apis.len(), 4);
        assert!(apis.values().all(|&n| n > 200), "{apis:?}");
    }

    #[test]
    fn only_the_named_apis_are_used() {
        assert!((0..100).all(|n| planned(1, 0, n, &[Api::Run]).api == Api::Run));
    }
}
