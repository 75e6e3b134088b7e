//! Who is master: the bully rule (the live node with the highest id) with terms.
//!
//! Every node hears every other's heartbeats and so knows which nodes are alive. Each
//! one computes the same answer from that set; when the answer is itself and it is not
//! yet master, it takes a term one higher than any it has seen and announces it (with a
//! snapshot of the state). A message from a master of a lower term than the highest one
//! seen is stale and ignored, which settles the moments when two nodes' views of who is
//! alive briefly differ.

use std::collections::BTreeSet;

use crate::NodeId;

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
