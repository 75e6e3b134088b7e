//! The node's identity (an ed25519 key kept in the data directory, so a restarted node
//! keeps its id) and the cluster key (32 bytes shared by every node; a node without it
//! cannot even complete a connection).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use libp2p::identity::Keypair;
use shoal_store::hex;

/// Loads the node key from `dir/identity.key`, or makes and saves one.
pub fn load_or_create_identity(dir: &Path) -> Result<Keypair> {
    let path = dir.join("identity.key");
    if let Ok(bytes) = std::fs::read(&path) {
        return Keypair::from_protobuf_encoding(&bytes)
            .with_context(|| format!("{} is not a node key", path.display()));
    }
    let key = Keypair::generate_ed25519();
    let bytes = key.to_protobuf_encoding().context("encode the node key")?;
    write_private(&path, &bytes)?;
    tracing::info!(path = %path.display(), "made a new node identity");
    Ok(key)
}

fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    std::fs::write(path, bytes).with_context(|| format!("cannot write {}", path.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600));
    }
    Ok(())
}

/// 32 random bytes from the OS.
fn random_key() -> Result<[u8; 32]> {
    use std::io::Read;
    let mut b = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .context("no randomness for a cluster key")?;
    Ok(b)
}

/// A new cluster key as 64 hex digits (`shoal keygen`).
pub fn new_cluster_key() -> Result<String> {
    Ok(hex(&random_key()?))
}

/// Parses 64 hex digits (surrounding whitespace ignored).
pub fn parse_cluster_key(text: &str) -> Result<[u8; 32]> {
    let t = text.trim();
    if t.len() != 64 || !t.bytes().all(|c| c.is_ascii_hexdigit()) {
        bail!("a cluster key is 64 hex digits (make one with `shoal keygen`)");
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&t[2 * i..2 * i + 2], 16).context("hex digit")?;
    }
    Ok(out)
}

/// Where the cluster key came from.
#[derive(Debug)]
pub enum KeySource {
    File(PathBuf),
    Env,
    /// Made now and saved here: other nodes need a copy.
    Made(PathBuf),
}

/// The cluster key: `--cluster-key-file`, else `SHOAL_CLUSTER_KEY`, else
/// `dir/cluster.key` (made on first start).
pub fn cluster_key(file: Option<&Path>, dir: &Path) -> Result<([u8; 32], KeySource)> {
    if let Some(f) = file {
        let text =
            std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))?;
        return Ok((parse_cluster_key(&text)?, KeySource::File(f.to_path_buf())));
    }
    if let Ok(text) = std::env::var("SHOAL_CLUSTER_KEY") {
        return Ok((parse_cluster_key(&text)?, KeySource::Env));
    }
    let path = dir.join("cluster.key");
    if let Ok(text) = std::fs::read_to_string(&path) {
        return Ok((parse_cluster_key(&text)?, KeySource::File(path)));
    }
    let key = random_key()?;
    write_private(&path, format!("{}\n", hex(&key)).as_bytes())?;
    Ok((key, KeySource::Made(path)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_bad_keys_are_refused() {
        let k = new_cluster_key().expect("key");
        assert_eq!(
            hex(&parse_cluster_key(&format!(" {k}\n")).expect("parse")),
            k
        );
        assert!(parse_cluster_key("abc").is_err());
        assert!(parse_cluster_key(&"g".repeat(64)).is_err());
        let dir = std::env::temp_dir().join(format!("shoal-keys-{}", std::process::id()));
        let a = load_or_create_identity(&dir).expect("make");
        let b = load_or_create_identity(&dir).expect("load");
        assert_eq!(a.public().to_peer_id(), b.public().to_peer_id());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
