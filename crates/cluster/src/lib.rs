//! The control plane's pure core: the replicated cluster state and the decisions made
//! on it. Nothing here does I/O, waits, or knows of tensors: the node daemon feeds events
//! in and carries decisions out.
//!
//! - [`state`]: [`ClusterState`], the [`Event`]s that change it, and
//!   [`apply`](state::apply), a pure function every replica runs on the same indexed
//!   events in the same order, so replicas converge.
//! - [`election`]: who is master (bully: the live node with the highest id) and terms.
//! - [`placement`]: [`place`](placement::place), which strategies and node sets can hold
//!   a model, with each node's memory, or why none can.
//! - [`worker`]: [`plan`](worker::plan), what a node must do with its runners given the
//!   state (start, stop, fetch a model), never waiting on a runner.

pub mod election;
pub mod placement;
pub mod state;
pub mod worker;

pub use placement::{ModelFacts, PlaceRequest, Plan, Refusal, place};
pub use state::{
    Backend, ClusterState, Event, Indexed, Instance, InstanceStatus, LinkStats, NodeId, NodeInfo,
    RankSlot, Resources, RunnerStatus, Strategy, apply,
};
