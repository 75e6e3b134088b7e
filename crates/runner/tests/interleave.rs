//! Regression: 2-rank tensor parallelism over TCP where new prompts arrive between the
//! decode steps of running sequences (the peer system deadlocked on exactly this, seed
//! 000). 500+ interleaved steps must neither hang nor change any sequence's tokens.

use std::thread;
use std::time::{Duration, Instant};

use candle_core::quantized::GgmlDType;
use shoal_collectives::Group;
use shoal_collectives::tcp::{TcpConfig, TcpTransport, loopback_listeners};
use shoal_engine::Session;
use shoal_model::synthetic::{SyntheticShape, write_synthetic_gguf};
use shoal_model::{Architecture, GgufFile, Model};
use shoal_runner::{Rank, SplitModel, Strategy, plan};

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % n
    }
}

fn argmax(logits: &candle_core::Tensor) -> u32 {
    let row = logits.to_vec2::<f32>().expect("logits").remove(0);
    row.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i as u32)
}

struct Job {
    prompt: Vec<u32>,
    decode: usize,
}

#[test]
fn prompts_arriving_between_decode_steps_neither_hang_nor_change_tokens() {
    let dir = std::env::temp_dir().join(format!("shoal-interleave-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let path = dir.join("qwen2.gguf");
    write_synthetic_gguf(
        &SyntheticShape::tiny(Architecture::Qwen2),
        GgmlDType::F32,
        11,
        &path,
    )
    .expect("write");
    let config = GgufFile::open(&path)
        .expect("open")
        .model_config()
        .expect("config")
        .clone();
    let specs = plan(&config, Strategy::Tensor, 2).expect("plan");
    let listeners = loopback_listeners(2).expect("listeners");
    let addrs: Vec<_> = listeners.iter().map(|(_, a)| *a).collect();
    let mut ranks = Vec::new();
    for ((listener, _), spec) in listeners.into_iter().zip(specs) {
        let addrs = addrs.clone();
        let path = path.clone();
        ranks.push(thread::spawn(move || {
            let t = TcpTransport::connect(&TcpConfig::new(spec.rank, addrs, "k"), listener)
                .expect("connect");
            let file = GgufFile::open(&path).expect("open");
            let model = Model::load(&file, spec.load.clone(), 512).expect("load");
            Rank::new(spec, model, Group::new(t, Duration::from_secs(20))).expect("rank")
        }));
    }
    let follower = ranks.pop().expect("rank 1").join().expect("join");
    let lead = ranks.pop().expect("rank 0").join().expect("join");
    let follower = thread::spawn(move || {
        let mut f = follower;
        f.follow()
    });
    let split = SplitModel::new(lead);

    let mut rng = Rng(5);
    let jobs: Vec<Job> = (0..48)
        .map(|_| Job {
            prompt: (0..1 + rng.below(24))
                .map(|_| rng.below(200) as u32)
                .collect(),
            decode: 4 + rng.below(14) as usize,
        })
        .collect();

    // One sequence at a time.
    let sequential: Vec<Vec<u32>> = jobs
        .iter()
        .map(|job| {
            let mut s = split.session();
            let mut next = argmax(&s.forward(&job.prompt, false).expect("prefill"));
            let mut out = vec![next];
            for _ in 1..job.decode {
                next = argmax(&s.forward(&[next], false).expect("decode"));
                out.push(next);
            }
            out
        })
        .collect();

    // Interleaved: up to five sequences in flight; each step either admits the next
    // prompt or advances a random running sequence by one token.
    let started = Instant::now();
    let mut active: Vec<(
        usize,
        shoal_runner::SplitSession<'_, TcpTransport>,
        Vec<u32>,
    )> = Vec::new();
    let mut results: Vec<Option<Vec<u32>>> = vec![None; jobs.len()];
    let mut admitted = 0;
    let mut steps = 0;
    while admitted < jobs.len() || !active.is_empty() {
        steps += 1;
        let admit =
            admitted < jobs.len() && (active.len() < 5 && (active.is_empty() || rng.below(3) == 0));
        if admit {
            let mut s = split.session();
            let first = argmax(&s.forward(&jobs[admitted].prompt, false).expect("prefill"));
            active.push((admitted, s, vec![first]));
            admitted += 1;
        } else {
            let i = rng.below(active.len() as u64) as usize;
            let (job, s, out) = &mut active[i];
            let last = *out.last().expect("one token at least");
            out.push(argmax(&s.forward(&[last], false).expect("decode")));
            if out.len() == jobs[*job].decode {
                let (job, _, out) = active.swap_remove(i);
                results[job] = Some(out);
            }
        }
    }
    assert!(steps >= 500, "only {steps} interleaved steps");
    assert_eq!(split.sequences(), 0, "every finished sequence was released");
    for (i, (want, got)) in sequential.iter().zip(&results).enumerate() {
        assert_eq!(Some(want), got.as_ref(), "job {i}");
    }
    eprintln!("{steps} interleaved steps in {:?}", started.elapsed());
    drop(active);
    split.shutdown().expect("shutdown");
    follower.join().expect("join").expect("rank 1 left cleanly");
}
