//! What each rank computes on, told to the others at setup, and the way of summing
//! partial results (through the host, or NCCL between one machine's GPUs) that every
//! rank derives alike from everyone's facts.

use shoal_model::Model;

use crate::shard::Strategy;

/// What a rank tells the others at setup, so that all of them decide alike whether to
/// join their GPUs with NCCL: all must compute on CUDA, on the same machine, in a build
/// with NCCL, for tensor parallelism, each on its own GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct DeviceFacts {
    /// On a CUDA device, for tensor parallelism (the only strategy with all-reduces).
    on_cuda: bool,
    /// Built with the `nccl` feature.
    with_nccl: bool,
    /// `host_id()` of the machine.
    host: u64,
    /// The CUDA ordinal (0 elsewhere).
    gpu: u32,
}

impl DeviceFacts {
    pub(super) fn of(model: &Model, strategy: Strategy) -> Self {
        Self {
            on_cuda: model.compute().device.is_cuda() && strategy == Strategy::Tensor,
            with_nccl: cfg!(feature = "nccl"),
            host: host_id(),
            gpu: match model.compute().device.location() {
                candle_core::DeviceLocation::Cuda { gpu_id } => gpu_id as u32,
                _ => 0,
            },
        }
    }

    /// As the group's all-gather carries them: seven integers below 2¹⁶, exact in f32.
    pub(super) fn encode(&self) -> Vec<f32> {
        let mut v = vec![
            f32::from(u8::from(self.on_cuda)),
            f32::from(u8::from(self.with_nccl)),
        ];
        v.extend((0..4).map(|i| ((self.host >> (16 * i)) & 0xffff) as f32));
        v.push((self.gpu & 0xffff) as f32);
        v
    }

    /// The facts a peer sent, or None when they are not seven such integers.
    pub(super) fn decode(v: &[f32]) -> Option<Self> {
        let word = |x: f32| ((0.0..65536.0).contains(&x) && x.fract() == 0.0).then_some(x as u64);
        if v.len() != 7 {
            return None;
        }
        let words: Option<Vec<u64>> = v.iter().map(|&x| word(x)).collect();
        let w = words?;
        Some(Self {
            on_cuda: w[0] == 1,
            with_nccl: w[1] == 1,
            host: w[2] | w[3] << 16 | w[4] << 32 | w[5] << 48,
            gpu: w[6] as u32,
        })
    }
}

/// How the ranks of a group sum their partial results.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reductions {
    /// Through the host over the group (CPUs, several machines, a mixed group).
    Host,
    /// Every rank is on a GPU of one machine, but NCCL cannot or may not join them (a
    /// build without it, two ranks on one GPU, `SHOAL_NCCL=0`): through the host, with a
    /// warning, since the user probably expected NCCL.
    HostInstead {
        all_nccl: bool,
        distinct_gpus: bool,
        wanted: bool,
    },
    /// NCCL between the GPUs.
    Nccl,
}

/// The decision every rank takes alike from everyone's facts (`None`: a peer sent
/// something unreadable, which rules NCCL out).
pub(super) fn reductions(facts: &[Option<DeviceFacts>], wanted: bool) -> Reductions {
    let Some(facts) = facts.iter().copied().collect::<Option<Vec<DeviceFacts>>>() else {
        return Reductions::Host;
    };
    let Some(first) = facts.first() else {
        return Reductions::Host;
    };
    let same_host = facts.iter().all(|f| f.host == first.host);
    let all_cuda = facts.iter().all(|f| f.on_cuda);
    if !(all_cuda && same_host && facts.len() > 1) {
        return Reductions::Host;
    }
    let all_nccl = facts.iter().all(|f| f.with_nccl);
    let mut gpus: Vec<u32> = facts.iter().map(|f| f.gpu).collect();
    gpus.sort_unstable();
    gpus.dedup();
    let distinct_gpus = gpus.len() == facts.len();
    if all_nccl && distinct_gpus && wanted {
        Reductions::Nccl
    } else {
        Reductions::HostInstead {
            all_nccl,
            distinct_gpus,
            wanted,
        }
    }
}

/// This machine's identity: its machine id, or its host name.
fn host_id() -> u64 {
    let text = std::fs::read_to_string("/etc/machine-id")
        .or_else(|_| std::fs::read_to_string("/proc/sys/kernel/hostname"))
        .unwrap_or_default();
    // FNV-1a: stable across processes and builds.
    text.trim().bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001b3)
    })
}

#[cfg(test)]
mod tests {
    use super::{DeviceFacts, Reductions, reductions};

    fn gpu(host: u64, gpu: u32) -> DeviceFacts {
        DeviceFacts {
            on_cuda: true,
            with_nccl: true,
            host,
            gpu,
        }
    }

    #[test]
    fn facts_travel_exactly() {
        for f in [
            gpu(0xdead_beef_0123_4567, 7),
            DeviceFacts {
                on_cuda: false,
                with_nccl: false,
                host: u64::MAX,
                gpu: 0,
            },
        ] {
            assert_eq!(DeviceFacts::decode(&f.encode()), Some(f));
        }
        assert_eq!(DeviceFacts::decode(&[1.0; 6]), None, "too short");
        assert_eq!(DeviceFacts::decode(&[1.5; 7]), None, "not integers");
        assert_eq!(DeviceFacts::decode(&[70000.0; 7]), None, "not 16-bit");
    }

    #[test]
    fn nccl_only_for_distinct_gpus_of_one_machine_all_built_with_it() {
        let two = [Some(gpu(1, 0)), Some(gpu(1, 1))];
        assert_eq!(reductions(&two, true), Reductions::Nccl);
        // Refused by the user, or two ranks on one GPU: through the host, with a warning.
        assert!(matches!(
            reductions(&two, false),
            Reductions::HostInstead { wanted: false, .. }
        ));
        let shared = [Some(gpu(1, 0)), Some(gpu(1, 0))];
        assert!(matches!(
            reductions(&shared, true),
            Reductions::HostInstead {
                distinct_gpus: false,
                ..
            }
        ));
        let mut without = gpu(1, 1);
        without.with_nccl = false;
        assert!(matches!(
            reductions(&[Some(gpu(1, 0)), Some(without)], true),
            Reductions::HostInstead {
                all_nccl: false,
                ..
            }
        ));
        // Two machines, a CPU rank, an unreadable peer, or one rank alone: the host path.
        assert_eq!(
            reductions(&[Some(gpu(1, 0)), Some(gpu(2, 1))], true),
            Reductions::Host
        );
        let mut cpu = gpu(1, 1);
        cpu.on_cuda = false;
        assert_eq!(
            reductions(&[Some(gpu(1, 0)), Some(cpu)], true),
            Reductions::Host
        );
        assert_eq!(reductions(&[Some(gpu(1, 0)), None], true), Reductions::Host);
        assert_eq!(reductions(&[Some(gpu(1, 0))], true), Reductions::Host);
    }
}
