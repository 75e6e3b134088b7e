//! Who is master: the bully rule (the live node with the highest id) with terms.
//!
//! Every node hears every other's heartbeats and so knows which nodes are alive. Each
//! one computes the same answer from that set; when the answer is itself and it is not
//! yet master, it takes a term one higher than any it has seen and announces it (with a
//! snapshot of the state). A message from a master of a lower term than the highest one
//! seen is stale and ignored, which settles the moments when two nodes' views of who is
//! alive briefly differ.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::NodeId;

/// What a node's heartbeat says about the state it holds, so that after a partition the
/// cluster keeps the state of the side that stayed bigger (its instances kept serving),
/// not whichever side's master happens to have the highest id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Standing {
    /// Nodes this one has seen up without a break for a while, itself included: while
    /// a partition heals, each side's count is still the size it had apart.
    pub side: usize,
    /// The term of the master that wrote the state (its branch).
    pub term: u64,
    pub index: u64,
}

impl Standing {
    /// Whether this state should replace `other`'s. On one branch (the same term) the
    /// longer log wins: a follower that got events a dead master's successor missed.
    /// Across branches (two sides of a partition) the bigger side wins, then the later
    /// term, then the longer log.
    pub fn outweighs(&self, other: &Standing) -> bool {
        if self.term == other.term {
            self.index > other.index
        } else {
            (self.side, self.term, self.index) > (other.side, other.term, other.index)
        }
    }
}

/// The peer whose state a node about to lead (or leading) should take first: the one
/// that outweighs it and every other such peer, if any.
pub fn heaviest<'a, K>(
    mine: &Standing,
    peers: impl IntoIterator<Item = (&'a K, &'a Standing)>,
) -> Option<&'a K>
where
    K: 'a,
{
    peers
        .into_iter()
        .filter(|(_, s)| s.outweighs(mine))
        .max_by_key(|(_, s)| (s.side, s.term, s.index))
        .map(|(k, _)| k)
}

/// What a node should do about mastership now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Become master with this term.
    Lead { term: u64 },
    /// Stay master.
    KeepLeading,
    /// Follow this node (it is or will be master).
    Follow(NodeId),
}

/// The master among `alive` (which includes the asking node).
pub fn master_of(alive: &BTreeSet<NodeId>) -> Option<&NodeId> {
    alive.iter().next_back()
}

/// The decision of node `me`, leading with term `leading` (or not leading), having seen
/// terms up to `highest_term`. A master that hears of a later term than its own (another
/// side of a partition elected one while they were apart) leads again with a term above
/// it, so that its snapshot replaces the other side's state everywhere.
pub fn decide(
    me: &NodeId,
    leading: Option<u64>,
    highest_term: u64,
    alive: &BTreeSet<NodeId>,
) -> Decision {
    match master_of(alive) {
        Some(m) if m == me && leading.is_some_and(|t| t >= highest_term) => Decision::KeepLeading,
        Some(m) if m == me => Decision::Lead {
            term: highest_term + 1,
        },
        Some(m) => Decision::Follow(m.clone()),
        // `alive` always holds `me`; an empty set means a lone node.
        None => Decision::Lead {
            term: highest_term + 1,
        },
    }
}

/// Whether a message from `from`, claiming `term`, comes from the master this node
/// should listen to.
pub fn accept_master(
    from: &NodeId,
    term: u64,
    highest_term: u64,
    expected: Option<&NodeId>,
) -> bool {
    term >= highest_term && expected.is_none_or(|m| m == from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(ids: &[&str]) -> BTreeSet<NodeId> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    fn standing(side: usize, term: u64, index: u64) -> Standing {
        Standing { side, term, index }
    }

    #[test]
    fn on_one_branch_the_longer_log_wins() {
        assert!(standing(3, 4, 10).outweighs(&standing(3, 4, 9)));
        assert!(!standing(3, 4, 9).outweighs(&standing(3, 4, 10)));
        assert!(!standing(3, 4, 9).outweighs(&standing(3, 4, 9)));
        // Side does not matter on one branch: a node just back sees a small side.
        assert!(standing(1, 4, 10).outweighs(&standing(3, 4, 9)));
    }

    #[test]
    fn across_a_healed_partition_the_bigger_side_wins() {
        // The majority kept the old term 1; the lone node elected itself with term 2
        // and wrote more events meanwhile.
        let majority = standing(2, 1, 58);
        let lone = standing(1, 2, 61);
        assert!(majority.outweighs(&lone));
        assert!(!lone.outweighs(&majority));
        // Equal sides: the later term.
        assert!(standing(2, 3, 5).outweighs(&standing(2, 2, 50)));
    }

    #[test]
    fn the_heaviest_peer_is_the_one_to_take_the_state_from() {
        let mine = standing(1, 2, 61);
        let peers = [
            ("a", standing(2, 1, 58)),
            ("b", standing(2, 1, 57)),
            ("c", standing(1, 2, 60)),
        ];
        let got = heaviest(&mine, peers.iter().map(|(k, s)| (k, s)));
        assert_eq!(got, Some(&"a"));
        // Nobody outweighs the majority's master.
        let mine = standing(2, 1, 58);
        assert_eq!(heaviest(&mine, peers.iter().map(|(k, s)| (k, s))), None);
    }

    #[test]
    fn the_highest_live_id_leads_and_takes_a_new_term() {
        let alive = set(&["a", "c", "b"]);
        assert_eq!(
            decide(&"c".into(), None, 4, &alive),
            Decision::Lead { term: 5 }
        );
        assert_eq!(
            decide(&"c".into(), Some(5), 5, &alive),
            Decision::KeepLeading
        );
        // A partition healed: the other side's master took term 7 meanwhile.
        assert_eq!(
            decide(&"c".into(), Some(5), 7, &alive),
            Decision::Lead { term: 8 }
        );
        assert_eq!(
            decide(&"a".into(), None, 5, &alive),
            Decision::Follow("c".into())
        );
        // c dies: b takes over with a higher term.
        let alive = set(&["a", "b"]);
        assert_eq!(
            decide(&"b".into(), None, 5, &alive),
            Decision::Lead { term: 6 }
        );
        assert_eq!(
            decide(&"a".into(), None, 6, &alive),
            Decision::Follow("b".into())
        );
        // A lone node leads itself.
        assert_eq!(
            decide(&"z".into(), None, 0, &set(&["z"])),
            Decision::Lead { term: 1 }
        );
    }

    #[test]
    fn stale_masters_are_ignored() {
        assert!(accept_master(&"c".into(), 5, 5, Some(&"c".into())));
        assert!(!accept_master(&"c".into(), 4, 5, Some(&"c".into())));
        assert!(!accept_master(&"b".into(), 5, 5, Some(&"c".into())));
        assert!(accept_master(&"b".into(), 6, 5, None));
    }
}
