//! A cluster's reads over UMBP's own bounded connections.
//!
//! The `redis` crate's cluster connection reads every reply with its own parser, which
//! allocates whatever length a bulk string declares. Values are read here instead: the slot
//! map comes from `CLUSTER NODES` (asked over a [`Link`]), each key goes to the primary that
//! serves its slot, and each primary's keys are one pipeline over a [`Link`] of its own, so
//! every reply passes UMBP's bounded reader. A redirection (`MOVED`, `ASK`, a slot no primary
//! serves) is an error [`crate::conn::is_redirect`] knows: the caller reconnects, which reads
//! the map again.

use std::time::Duration;

use redis::{ErrorKind, IntoConnectionInfo, RedisError, RedisResult, ServerErrorKind};

use crate::link::Link;

const SLOTS: usize = 16384;
const UNOWNED: u16 = u16::MAX;

/// The slot of `key`: CRC16 (XMODEM) of its hash tag (the part inside the first `{...}`, when
/// not empty) or of the whole key, modulo 16384, as Redis Cluster computes it.
pub(crate) fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let close = key[open + 1..].iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &key[open + 1..open + 1 + close])
    });
    let mut crc: u16 = 0;
    for &b in tagged.unwrap_or(key) {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % SLOTS as u16
}

/// Primaries and the slot ranges each serves, from a `CLUSTER NODES` reply (failed primaries,
/// replicas and slots being migrated are left out).
pub(crate) fn slot_map(nodes: &str) -> (Vec<(String, u16)>, Vec<u16>) {
    let mut addrs = Vec::new();
    let mut owner = vec![UNOWNED; SLOTS];
    for l in nodes.lines() {
        let f: Vec<&str> = l.split_whitespace().collect();
        let Some(flags) = f.get(2) else { continue };
        if !flags.contains("master") || flags.contains("fail") || f.len() < 9 {
            continue;
        }
        let Some((host, port)) = f[1]
            .split(['@', ','])
            .next()
            .and_then(|a| a.rsplit_once(':'))
            .and_then(|(h, p)| Some((h.to_string(), p.parse::<u16>().ok()?)))
        else {
            continue;
        };
        let idx = addrs.len() as u16;
        addrs.push((host, port));
        for range in &f[8..] {
            if range.starts_with('[') {
                continue; // "[slot->-node]" / "[slot-<-node]": being migrated
            }
            let (a, b) = range.split_once('-').unwrap_or((range, range));
            if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                if a <= b && a < SLOTS {
                    owner[a..=b.min(SLOTS - 1)].fill(idx);
                }
            }
        }
    }
    (addrs, owner)
}

/// `seed`'s URL (scheme, user, password, TLS suffix) pointed at `host:port`.
fn node_url(seed: &str, host: &str, port: u16) -> String {
    let (scheme, rest) = seed.split_once("://").unwrap_or(("redis", seed));
    let (auth, hostpart) = match rest.rsplit_once('@') {
        Some((a, h)) => (format!("{a}@"), h),
        None => (String::new(), rest),
    };
    let tail = hostpart.find('/').map_or("", |i| &hostpart[i..]);
    let host = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_string()
    };
    format!("{scheme}://{auth}{host}:{port}{tail}")
}

fn not_served(slot: u16) -> RedisError {
    RedisError::from((
        ErrorKind::Server(ServerErrorKind::TryAgain),
        "no primary serves the slot in the map read at connect",
        format!("slot {slot}"),
    ))
}

/// The slot map and a bounded connection per primary (made when first needed).
pub(crate) struct ClusterReads {
    seed: String,
    timeout: Duration,
    nodes: Vec<(String, u16)>,
    owner: Vec<u16>,
    links: Vec<Option<Link>>,
}

impl ClusterReads {
    /// Reads the slot map from the first of `seeds` that answers `CLUSTER NODES`.
    pub(crate) fn connect(seeds: &[String], timeout: Duration) -> RedisResult<ClusterReads> {
        let mut last = None;
        for seed in seeds {
            let got = seed.as_str().into_connection_info().and_then(|info| {
                let mut link = Link::connect_to(&info, timeout)?;
                let text: String = redis::cmd("CLUSTER").arg("NODES").query(&mut link)?;
                Ok(text)
            });
            match got {
                Ok(text) => {
                    let (nodes, owner) = slot_map(&text);
                    let links = nodes.iter().map(|_| None).collect();
                    return Ok(ClusterReads {
                        seed: seed.clone(),
                        timeout,
                        nodes,
                        owner,
                        links,
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            RedisError::from((ErrorKind::Client, "no seed nodes", String::new()))
        }))
    }

    fn link(&mut self, node: usize) -> RedisResult<&mut Link> {
        if self.links[node]
            .as_ref()
            .is_none_or(|l| !redis::ConnectionLike::is_open(l))
        {
            let (host, port) = &self.nodes[node];
            let info = node_url(&self.seed, host, *port).into_connection_info()?;
            self.links[node] = Some(Link::connect_to(&info, self.timeout)?);
        }
        Ok(self.links[node].as_mut().expect("connected above"))
    }

    fn node_of(&self, key: &str) -> RedisResult<usize> {
        let slot = key_slot(key.as_bytes());
        match self.owner[slot as usize] {
            UNOWNED => Err(not_served(slot)),
            n => Ok(n as usize),
        }
    }

    /// Every key's `GETRANGE key 0 limit` reply, in order: one pipeline per primary.
    pub(crate) fn get_ranges(&mut self, keys: &[String], limit: u64) -> RedisResult<Vec<Vec<u8>>> {
        let mut by_node: Vec<Vec<usize>> = vec![Vec::new(); self.nodes.len()];
        for (i, k) in keys.iter().enumerate() {
            by_node[self.node_of(k)?].push(i);
        }
        let mut out = vec![Vec::new(); keys.len()];
        for (node, idx) in by_node.into_iter().enumerate() {
            if idx.is_empty() {
                continue;
            }
            let mut p = redis::pipe();
            for &i in &idx {
                p.cmd("GETRANGE").arg(&keys[i]).arg(0).arg(limit);
            }
            let got: Vec<Vec<u8>> = p.query(self.link(node)?)?;
            for (i, v) in idx.into_iter().zip(got) {
                out[i] = v;
            }
        }
        Ok(out)
    }

    /// One `GETRANGE key 0 limit` on the primary that serves `key`.
    pub(crate) fn get_range(&mut self, key: &str, limit: u64) -> RedisResult<Vec<u8>> {
        let node = self.node_of(key)?;
        redis::cmd("GETRANGE")
            .arg(key)
            .arg(0)
            .arg(limit)
            .query(self.link(node)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_redis_clusters() {
        // Values from `CLUSTER KEYSLOT` (and the CRC16 check value of "123456789").
        assert_eq!(key_slot(b"123456789"), 0x31C3);
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), key_slot(b"foo{}{bar}"));
        assert_ne!(key_slot(b"foo{}{bar}"), key_slot(b"bar"));
        assert_eq!(key_slot(b"{}"), key_slot(b"{}"));
    }

    #[test]
    fn the_map_comes_from_cluster_nodes() {
        let nodes = "\
a1 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460
b2 10.0.0.2:7001@17001,host-b master - 0 0 2 connected 5461-10921 10922 [10923->-a1]
c3 127.0.0.1:7002@17002 slave b2 0 0 2 connected
d4 127.0.0.1:7003@17003 master,fail - 0 0 3 connected 10923-16383
e5 127.0.0.1:7004@17004 master - 0 0 4 connected
";
        let (addrs, owner) = slot_map(nodes);
        assert_eq!(
            addrs,
            [
                ("127.0.0.1".to_string(), 7000),
                ("10.0.0.2".to_string(), 7001)
            ]
        );
        assert_eq!((owner[0], owner[5460], owner[5461]), (0, 0, 1));
        assert_eq!(
            (owner[10922], owner[10923], owner[16383]),
            (1, UNOWNED, UNOWNED)
        );
    }

    #[test]
    fn node_urls_keep_the_seeds_credentials_and_tls() {
        assert_eq!(
            node_url("redis://:pw@a:7000", "10.0.0.2", 7001),
            "redis://:pw@10.0.0.2:7001"
        );
        assert_eq!(
            node_url("rediss://u:p@a:1/#insecure", "b", 2),
            "rediss://u:p@b:2/#insecure"
        );
        assert_eq!(node_url("redis://a:1", "::1", 3), "redis://[::1]:3");
    }
}
