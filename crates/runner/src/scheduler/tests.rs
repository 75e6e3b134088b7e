//! The scheduler's decisions, case by case.

use super::*;

fn limits() -> Limits {
    Limits {
        step_tokens: 16,
        max_batch: 4,
        kv_positions: 1000,
        max_queue: 8,
        stages: 1,
        lone_prompt_rows: false,
    }
}

fn waiting(id: u64, prompt: usize, max_new: usize) -> Waiting {
    Waiting {
        id,
        prompt,
        max_new,
    }
}

/// Only the bound beside streams.
fn gap(gap: f64) -> StepBounds {
    StepBounds { gap, ms: 0.0 }
}

fn running(id: u64, prompt: usize, prefilled: usize) -> Running {
    Running {
        id,
        prompt,
        max_new: 10,
        prefilled,
        in_flight: false,
    }
}

#[test]
fn decode_tokens_come_first_then_prompt_slices_within_the_budget() {
    let r = [
        running(1, 4, 4),
        running(2, 100, 0),
        running(3, 5, 5),
        running(4, 9, 0),
    ];
    let step = next_step(&r, &limits(), usize::MAX);
    assert_eq!(
        step,
        vec![
            Work::Decode { id: 1 },
            Work::Decode { id: 3 },
            Work::Prefill {
                id: 2,
                start: 0,
                len: 7,
                last: false
            },
            Work::Prefill {
                id: 4,
                start: 0,
                len: 7,
                last: false
            },
        ],
        "two decodes, then the 14 tokens left: half to the later prompt, half to the oldest"
    );
    let tokens: usize = step
        .iter()
        .map(|w| match w {
            Work::Decode { .. } => 1,
            Work::Prefill { len, .. } => *len,
        })
        .sum();
    assert!(tokens <= limits().step_tokens);
}

#[test]
fn a_prompt_is_sliced_across_steps_and_its_last_slice_says_so() {
    let mut r = vec![running(1, 40, 0)];
    let mut slices = Vec::new();
    while !r[0].decoding() {
        let step = next_step(&r, &limits(), usize::MAX);
        let [
            Work::Prefill {
                start, len, last, ..
            },
        ] = step[..]
        else {
            panic!("one prefill slice: {step:?}");
        };
        assert_eq!(start, r[0].prefilled);
        r[0].prefilled += len;
        slices.push((len, last));
    }
    assert_eq!(slices, vec![(16, false), (16, false), (8, true)]);
    assert_eq!(
        next_step(&r, &limits(), usize::MAX),
        vec![Work::Decode { id: 1 }]
    );
}

#[test]
fn a_long_prompt_never_stops_the_streams() {
    // Four streams and a 4000-token prompt: every step still carries all four.
    let mut r = vec![
        running(1, 3, 3),
        running(2, 3, 3),
        running(3, 3, 3),
        running(9, 4000, 0),
    ];
    for _ in 0..300 {
        let step = next_step(&r, &limits(), usize::MAX);
        let decodes = step
            .iter()
            .filter(|w| matches!(w, Work::Decode { .. }))
            .count();
        assert_eq!(decodes, 3);
        if let Some(Work::Prefill { len, .. }) =
            step.iter().find(|w| matches!(w, Work::Prefill { .. }))
        {
            assert!(*len <= limits().step_tokens - 3);
            r[3].prefilled += len;
        }
    }
    assert!(r[3].prefilled > 0, "the prompt progressed too");
}

#[test]
fn admission_is_first_come_first_served_within_batch_and_memory() {
    let l = limits();
    let w = [
        waiting(1, 100, 100),
        waiting(2, 100, 100),
        waiting(3, 10, 10),
    ];
    assert_eq!(admit(&w, &[], &l), vec![1, 2, 3]);
    // Memory: 600 in use leaves room for two of 200, not a third; the small one
    // behind the one that does not fit waits its turn.
    let busy = [Running {
        id: 7,
        prompt: 300,
        max_new: 300,
        prefilled: 300,
        in_flight: false,
    }];
    let w = [
        waiting(1, 100, 100),
        waiting(2, 100, 100),
        waiting(3, 100, 100),
        waiting(4, 1, 1),
    ];
    assert_eq!(admit(&w, &busy, &l), vec![1, 2]);
    // Batch: four at most.
    let full: Vec<Running> = (10..14).map(|i| running(i, 1, 1)).collect();
    assert!(admit(&[waiting(1, 1, 1)], &full, &l).is_empty());
}

#[test]
fn kept_prompts_give_up_only_what_the_first_in_line_lacks() {
    let l = limits(); // 4 sequences, 1000 positions
    let r = [running(1, 300, 300)]; // 310 reserved
    let w = [waiting(2, 400, 90)]; // 490 wanted
    assert_eq!(reserved(&r), 310);
    assert_eq!(kept_to_free(&w, &r, 100, &l), 0, "fits beside 100 kept");
    assert_eq!(kept_to_free(&w, &r, 300, &l), 100);
    assert_eq!(kept_to_free(&[], &r, 900, &l), 0, "nobody waiting");
    let full: Vec<Running> = (1..=4).map(|id| running(id, 10, 10)).collect();
    assert_eq!(
        kept_to_free(&w, &full, 900, &l),
        0,
        "the batch is full anyway"
    );
}

#[test]
fn a_cancelled_sequence_frees_its_room_at_once() {
    let l = Limits {
        max_batch: 1,
        ..limits()
    };
    let mut r = vec![running(1, 10, 10)];
    let w = [waiting(2, 5, 5)];
    assert!(admit(&w, &r, &l).is_empty());
    r.retain(|s| s.id != 1); // cancelled
    assert_eq!(admit(&w, &r, &l), vec![2]);
    assert!(next_step(&r, &l, usize::MAX).is_empty());
}

#[test]
fn the_queue_is_bounded_and_a_request_too_big_for_the_instance_is_known_at_once() {
    let l = limits();
    assert!(may_queue(7, &l));
    assert!(!may_queue(8, &l));
    assert!(fits_at_all(&waiting(1, 500, 500), &l));
    assert!(!fits_at_all(&waiting(1, 900, 101), &l));
}

#[test]
fn every_decoding_sequence_gets_a_token_every_step() {
    // Fairness between streams: no stream is skipped however many there are
    // (the batch limit keeps their number within the budget).
    let r: Vec<Running> = (0..4).map(|i| running(i, 2, 2)).collect();
    for _ in 0..10 {
        let ids: Vec<u64> = next_step(&r, &limits(), usize::MAX)
            .iter()
            .map(|w| match w {
                Work::Decode { id } => *id,
                Work::Prefill { id, .. } => *id,
            })
            .collect();
        assert_eq!(ids, vec![0, 1, 2, 3]);
    }
}

fn ids(work: &[Work]) -> Vec<u64> {
    work.iter().map(Work::id).collect()
}

#[test]
fn a_pipeline_keeps_a_micro_batch_per_stage_in_flight() {
    let l = Limits {
        stages: 2,
        ..limits()
    };
    // Eight streams over two stages: two micro-batches of four.
    let mut r: Vec<Running> = (0..8).map(|i| running(i, 2, 2)).collect();
    let a = next_step(&r, &l, usize::MAX);
    assert_eq!(ids(&a), vec![0, 1, 2, 3]);
    for s in &mut r[..4] {
        s.in_flight = true;
    }
    let b = next_step(&r, &l, usize::MAX);
    assert_eq!(ids(&b), vec![4, 5, 6, 7]);
    for s in &mut r[4..] {
        s.in_flight = true;
    }
    assert!(next_step(&r, &l, usize::MAX).is_empty(), "both stages busy");
    // The first comes back: its four go again, the others still wait.
    for s in &mut r[..4] {
        s.in_flight = false;
    }
    assert_eq!(ids(&next_step(&r, &l, usize::MAX)), vec![0, 1, 2, 3]);
    // An odd count: shares of five and four; one stream alone goes alone.
    let r: Vec<Running> = (0..9).map(|i| running(i, 2, 2)).collect();
    assert_eq!(next_step(&r, &l, usize::MAX).len(), 5);
    assert_eq!(next_step(&r[..1], &l, usize::MAX).len(), 1);
    // A prompt's slices follow each other through the stages; one whose last slice
    // is in flight (it waits for its first token's logits) sits out.
    let mut r = vec![running(1, 100, 40)];
    assert_eq!(
        next_step(&r, &l, usize::MAX),
        vec![Work::Prefill {
            id: 1,
            start: 40,
            len: 16,
            last: false
        }]
    );
    r[0].prefilled = 100;
    r[0].in_flight = true;
    assert!(next_step(&r, &l, usize::MAX).is_empty());
}

#[test]
fn beside_streams_a_prompt_slice_is_sized_by_time() {
    let l = Limits {
        step_tokens: 256,
        ..limits()
    };
    let mut costs = StepCosts::default();
    // Nothing known yet: a step of the stream alone, to learn what it costs.
    assert_eq!(prompt_budget(&costs, 1, gap(2.0), &l), 0);
    let r = [running(1, 4, 4), running(2, 100, 0)];
    assert_eq!(next_step(&r, &l, 0), [Work::Decode { id: 1 }]);
    // Without a bound beside streams, the whole budget.
    assert_eq!(prompt_budget(&costs, 1, gap(0.0), &l), 255);
    // Decode-only steps of 10 ms; a lone 256-token slice of 256 ms: 1 ms a token.
    for _ in 0..20 {
        costs.observe(1, 0, 10.0);
        costs.observe(0, 256, 256.0);
    }
    assert!((costs.decode.unwrap() - 10.0).abs() < 1e-9);
    assert!((costs.per_prompt_token.unwrap() - 1.0).abs() < 1e-9);
    // A bound of 2: (0.8 · 2 − 1) · 10 ms = 6 ms of room, six tokens.
    assert_eq!(prompt_budget(&costs, 1, gap(2.0), &l), 6);
    // Beside the streams a prompt token costs 2 ms (its own pass through the layers,
    // attention further back): three tokens.
    for _ in 0..40 {
        costs.observe(1, 6, 10.0 + 12.0);
    }
    assert!(
        (costs.per_token_beside.unwrap() - 2.0).abs() < 0.01,
        "{costs:?}"
    );
    assert_eq!(prompt_budget(&costs, 1, gap(2.0), &l), 3);
    // However tight, a prompt still progresses; without streams or a bound it takes
    // the whole budget.
    assert_eq!(prompt_budget(&costs, 1, gap(1.0), &l), 1);
    assert_eq!(prompt_budget(&costs, 0, gap(2.0), &l), 256);
    assert_eq!(prompt_budget(&costs, 3, gap(0.0), &l), 253);
    // And the step obeys it.
    let r = [running(1, 4, 4), running(2, 100, 0)];
    let step = next_step(&r, &l, prompt_budget(&costs, 1, gap(2.0), &l));
    assert_eq!(
        step[1],
        Work::Prefill {
            id: 2,
            start: 0,
            len: 3,
            last: false
        }
    );
}

#[test]
fn a_dearer_prompt_token_alone_is_believed_sooner_than_a_cheaper_one() {
    let l = Limits {
        step_tokens: 512,
        ..limits()
    };
    let bounds = StepBounds {
        gap: 0.0,
        ms: 500.0,
    };
    let mut costs = StepCosts::default();
    costs.observe(0, 100, 100.0);
    // 1 ms a token: 400 ms of room (80% of the bound) is 400 tokens.
    assert_eq!(prompt_budget(&costs, 0, bounds, &l), 400);
    // Further into a long prompt a token costs 2 ms: half of the difference at once, so
    // the next slice (400 ms of room) is 266 tokens; a plain average (1.2 ms) would give
    // 333, which at 2 ms a token overrun the 500 ms bound by a third.
    costs.observe(0, 200, 400.0);
    assert!(
        (costs.per_prompt_token.unwrap() - 1.5).abs() < 1e-9,
        "{costs:?}"
    );
    assert_eq!(prompt_budget(&costs, 0, bounds, &l), 266);
    costs.observe(0, 200, 400.0);
    assert!((costs.per_prompt_token.unwrap() - 1.75).abs() < 1e-9);
    // Cheaper again: a fifth of the way down.
    costs.observe(0, 200, 200.0);
    assert!((costs.per_prompt_token.unwrap() - 1.6).abs() < 1e-9);
    // The decode-only cost and the cost beside streams stay plain averages.
    costs.observe(1, 0, 10.0);
    costs.observe(1, 0, 20.0);
    assert!((costs.decode.unwrap() - 12.0).abs() < 1e-9);
    costs.observe(1, 4, 12.0 + 4.0);
    costs.observe(1, 4, 12.0 + 12.0);
    assert!(
        (costs.per_token_beside.unwrap() - 1.4).abs() < 1e-9,
        "{costs:?}"
    );
}

#[test]
fn any_step_is_bounded_in_time_so_a_long_prompt_hears_a_cancel() {
    let l = Limits {
        step_tokens: 256,
        ..limits()
    };
    let bounds = StepBounds {
        gap: 2.0,
        ms: 500.0,
    };
    // Nothing known: a first slice of 64 tokens alone, to learn what a token costs.
    let mut costs = StepCosts::default();
    assert_eq!(prompt_budget(&costs, 0, bounds, &l), 2 * MIN_SLICE);
    // Only a decode step's cost known (20 ms): it stands in for a prompt token, and
    // 400 ms of room is 20 tokens, raised to the smallest useful slice.
    costs.observe(1, 0, 20.0);
    assert_eq!(prompt_budget(&costs, 0, bounds, &l), MIN_SLICE);
    // Prompt tokens of 5 ms alone: 80 of them in 400 ms, not the whole 256.
    for _ in 0..40 {
        costs.observe(0, 64, 64.0 * 5.0);
    }
    assert_eq!(prompt_budget(&costs, 0, bounds, &l), 80);
    // Cheap tokens: the token budget is the bound.
    let cheap = StepCosts {
        per_prompt_token: Some(0.01),
        ..costs
    };
    assert_eq!(prompt_budget(&cheap, 0, bounds, &l), 256);
    // Beside a stream the tighter of the two bounds holds: (0.8 · 2 − 1) · 20 ms is
    // 12 ms of room beside the stream, two tokens, under the 19 the time bound allows.
    assert_eq!(prompt_budget(&costs, 1, bounds, &l), 2);
    let loose = StepBounds {
        gap: 100.0,
        ms: 500.0,
    };
    // (400 − 20) ms / 5 ms = 76 tokens by time; the gap bound would allow 316.
    assert_eq!(prompt_budget(&costs, 1, loose, &l), 76);
    // Without a time bound a lone prompt takes the whole budget.
    assert_eq!(prompt_budget(&costs, 0, gap(2.0), &l), 256);
}

#[test]
fn a_short_prompt_is_not_kept_behind_a_long_one_nor_does_it_starve_it() {
    let l = Limits {
        step_tokens: 256,
        ..limits()
    };
    let prefill = |id, start, len, last| Work::Prefill {
        id,
        start,
        len,
        last,
    };
    // A 4000-token prompt being read, a 20-token question arrives: the question is
    // read whole in the next step, the long prompt takes the rest.
    let r = [running(1, 4000, 512), running(2, 20, 0)];
    assert_eq!(
        next_step(&r, &l, usize::MAX),
        [prefill(1, 512, 236, false), prefill(2, 0, 20, true)]
    );
    // A question of 200 under a budget of 66 (a time-bounded step): half of it each
    // step, so it is read in a few steps, not after the whole long prompt.
    let r = [running(1, 4000, 512), running(2, 200, 0)];
    assert_eq!(
        next_step(&r, &l, 66),
        [prefill(1, 512, 33, false), prefill(2, 0, 33, false)]
    );
    // Six questions of 30: shortest and then oldest first within half the budget
    // (the fifth gets what is left of the half); the long prompt keeps its half.
    let mut r = vec![running(1, 4000, 512)];
    r.extend((2..8).map(|id| running(id, 30, 0)));
    r[3].prompt = 25;
    let step = next_step(&r, &l, usize::MAX);
    assert_eq!(
        step,
        [
            prefill(1, 512, 128, false),
            prefill(4, 0, 25, true),
            prefill(2, 0, 30, true),
            prefill(3, 0, 30, true),
            prefill(5, 0, 30, true),
            prefill(6, 0, 13, false),
        ]
    );
    // A prompt alone takes the whole budget; so does the oldest when the others are
    // done with theirs, and what the oldest cannot use goes to the others.
    let r = [running(1, 4000, 0)];
    assert_eq!(next_step(&r, &l, usize::MAX), [prefill(1, 0, 256, false)]);
    let r = [running(1, 10, 0), running(2, 300, 0)];
    assert_eq!(
        next_step(&r, &l, usize::MAX),
        [prefill(1, 0, 10, true), prefill(2, 0, 246, false)]
    );
    // Prompts that all end within the step keep the order they came in.
    let r = [running(1, 10, 0), running(2, 30, 0), running(3, 5, 0)];
    assert_eq!(
        next_step(&r, &l, usize::MAX),
        [
            prefill(1, 0, 10, true),
            prefill(2, 0, 30, true),
            prefill(3, 0, 5, true)
        ]
    );
    // Beside streams, the same rules within what is left.
    let r = [running(1, 4, 4), running(2, 4000, 100), running(3, 5, 0)];
    assert_eq!(
        next_step(&r, &l, 12),
        [
            Work::Decode { id: 1 },
            prefill(2, 100, 7, false),
            prefill(3, 0, 5, true)
        ]
    );
}

#[test]
fn no_prompt_row_is_read_alone_unless_the_prompt_is_one_token() {
    // (slice, left) -> slice: a lone row grows to two, a slice that would leave one
    // gives it up or takes it.
    for (len, left, want) in [
        (1, 1, 1),
        (1, 2, 2),
        (1, 3, 3),
        (2, 3, 3),
        (1, 4, 2),
        (3, 4, 2),
        (4, 4, 4),
        (7, 8, 6),
        (5, 8, 5),
        (9, 8, 8),
    ] {
        assert_eq!(whole_rows(len, left), want, "{len} of {left}");
    }
    // Beside a stream, a one-token budget reads two rows of a prompt, and never leaves
    // its last row alone.
    let l = limits();
    let r = [running(1, 4, 4), running(2, 100, 0)];
    assert_eq!(
        next_step(&r, &l, 1),
        vec![
            Work::Decode { id: 1 },
            Work::Prefill {
                id: 2,
                start: 0,
                len: 2,
                last: false
            }
        ]
    );
    let r = [running(1, 4, 4), running(2, 100, 96)];
    assert_eq!(
        next_step(&r, &l, 3),
        vec![
            Work::Decode { id: 1 },
            Work::Prefill {
                id: 2,
                start: 96,
                len: 2,
                last: false
            }
        ]
    );
}

#[test]
fn where_a_lone_row_computes_alike_a_prompt_slice_may_be_one_row() {
    let l = Limits {
        lone_prompt_rows: true,
        ..limits()
    };
    // Beside a stream a one-token budget reads one row (the gap bound's smallest step:
    // on a 2-core CPU a second prompt row costs a third of a decode step more).
    let r = [running(1, 4, 4), running(2, 100, 0)];
    assert_eq!(
        next_step(&r, &l, 1),
        vec![
            Work::Decode { id: 1 },
            Work::Prefill {
                id: 2,
                start: 0,
                len: 1,
                last: false
            }
        ]
    );
    // A slice may leave one row, and the last row may be read alone.
    for (start, len, last) in [(96, 3, false), (99, 1, true)] {
        let r = [running(1, 4, 4), running(2, 100, start)];
        assert_eq!(
            next_step(&r, &l, 3)[1],
            Work::Prefill {
                id: 2,
                start,
                len,
                last
            }
        );
    }
}

#[test]
fn prompts_arriving_with_a_young_stream_are_read_together_but_a_settled_one_keeps_its_gap() {
    let l = Limits {
        step_tokens: 256,
        max_batch: 8,
        ..limits()
    };
    // Decode-only steps of 10 ms; a prompt token beside them 2 ms.
    let mut costs = StepCosts::default();
    for _ in 0..40 {
        costs.observe(1, 0, 10.0);
        costs.observe(1, 6, 22.0);
    }
    // Eight clients at once: the first's prompt was read alone, seven wait (10 tokens
    // each) beside its stream.
    let mut r = vec![running(1, 10, 10)];
    r.extend((2..=8).map(|id| running(id, 10, 0)));
    let bounds = |settled| StepBounds {
        gap: gap_for(2.0, settled),
        ms: 500.0,
    };
    // While no stream has SETTLED tokens: every prompt whole in this one step.
    let budget = prompt_budget(&costs, 1, bounds(0), &l);
    let step = next_step(&r, &l, budget);
    assert_eq!(step.len(), 8, "{step:?}");
    assert!(step[1..].iter().all(|w| matches!(
        w,
        Work::Prefill {
            len: 10,
            last: true,
            ..
        }
    )));
    // Once it has: (0.8 · 2 − 1) · 10 ms of room at 2 ms a token, three tokens.
    let budget = prompt_budget(&costs, 1, bounds(1), &l);
    assert_eq!(budget, 3);
    let step = next_step(&r, &l, budget);
    let prompt: usize = step
        .iter()
        .map(|w| match w {
            Work::Prefill { len, .. } => *len,
            Work::Decode { .. } => 0,
        })
        .sum();
    assert!(prompt <= 4, "{step:?}");
    // Whatever the streams' age, the step-time bound holds: 400 ms of 2 ms tokens.
    let long = [running(1, 10, 10), running(2, 4000, 0)];
    let budget = prompt_budget(&costs, 1, bounds(0), &l);
    assert_eq!(budget, 195);
    assert_eq!(
        next_step(&long, &l, budget)[1],
        Work::Prefill {
            id: 2,
            start: 0,
            len: 195,
            last: false
        }
    );
    assert_eq!(gap_for(2.0, 3), 2.0);
}
