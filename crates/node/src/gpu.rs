//! This machine's GPUs as `nvidia-smi` reports them (placement counts their memory).

use std::time::Duration;

/// The GPUs of this machine as `nvidia-smi` reports them: the first one's name and
/// total memory, the least free memory of any, and how many there are.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpu {
    pub name: String,
    pub total: u64,
    pub free: u64,
    pub count: u32,
}

/// The GPUs, or `None` (no tool, no GPU, or no answer within 5 s).
pub async fn query_gpu() -> Option<Gpu> {
    let run = tokio::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=name,memory.total,memory.free",
            "--format=csv,noheader,nounits",
        ])
        .output();
    let out = tokio::time::timeout(Duration::from_secs(5), run)
        .await
        .ok()?
        .ok()?;
    if !out.status.success() {
        return None;
    }
    parse_gpus(&String::from_utf8_lossy(&out.stdout))
}

/// `nvidia-smi --query-gpu=name,memory.total,memory.free --format=csv,noheader,nounits`.
fn parse_gpus(text: &str) -> Option<Gpu> {
    let mib = |v: Option<&str>| v.and_then(|x| x.parse::<u64>().ok()).map(|m| m << 20);
    let mut gpu: Option<Gpu> = None;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split(',').map(str::trim);
        let name = f.next()?.to_string();
        let total = mib(f.next())?;
        // Rounded, so that small changes do not make events.
        let free = mib(f.next())? / (256 << 20) * (256 << 20);
        gpu = Some(match gpu {
            None => Gpu {
                name,
                total,
                free,
                count: 1,
            },
            Some(g) => Gpu {
                free: g.free.min(free),
                count: g.count + 1,
                ..g
            },
        });
    }
    gpu
}

#[cfg(test)]
mod tests {
    use super::parse_gpus;

    #[test]
    fn nvidia_smi_lines_become_a_gpu_count_with_the_least_free_memory() {
        let two = "NVIDIA H200, 143771, 143000\nNVIDIA H200, 143771, 100000\n";
        let g = parse_gpus(two).expect("two GPUs");
        assert_eq!(g.count, 2);
        assert_eq!(g.name, "NVIDIA H200");
        assert_eq!(g.total, 143771 << 20);
        assert_eq!(g.free, (100000u64 << 20) / (256 << 20) * (256 << 20));
        assert_eq!(parse_gpus(""), None);
        assert_eq!(parse_gpus("No devices were found"), None);
    }
}
