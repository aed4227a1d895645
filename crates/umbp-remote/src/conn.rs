//! Connections to the remote store: one Redis / Valkey server, or a cluster.
//!
//! Everything here is synchronous and bounded by timeouts: the tier's own threads call it,
//! never the engine's.

use std::time::{Duration, Instant};

use redis::cluster::{cluster_pipe, ClusterClient, ClusterClientBuilder, ClusterConnection};
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{ConnectionInfo, IntoConnectionInfo, RedisResult};

use crate::cluster::ClusterReads;
use crate::link::Link;
use crate::resp::with_bulk_limit;

use umbp_core::address::redact_url;

use crate::error::RemoteError;

/// Where the remote store is, parsed from `remote_url`.
///
/// `rediss://` (and `rediss+cluster://`) connect with TLS: the server's certificate is checked
/// against the system's roots (or the file named by `SSL_CERT_FILE`); a `#insecure` suffix
/// skips that check (self-signed test set-ups only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One server: `redis://[user:password@]host[:port][/db]` (`valkey://` is the same).
    Single(String),
    /// A cluster, by its seed nodes: `redis+cluster://[user:password@]host:port[,host:port...]`.
    Cluster(Vec<String>),
}

impl Target {
    /// Whether it connects with TLS.
    pub fn tls(&self) -> bool {
        match self {
            Target::Single(u) => u.starts_with("rediss://"),
            Target::Cluster(s) => s.iter().any(|u| u.starts_with("rediss://")),
        }
    }
}

impl Target {
    /// Parses `remote_url`. Errors name what to change.
    pub fn parse(url: &str) -> Result<Target, RemoteError> {
        let bad = |why: &str| RemoteError::Url {
            url: redact_url(url),
            why: why.to_string(),
        };
        let (scheme, rest) = url.split_once("://").ok_or_else(|| {
            bad("it has no scheme; write redis://host:port or redis+cluster://host:port,host:port")
        })?;
        let scheme = scheme.to_ascii_lowercase();
        let (cluster, tls) = match scheme.as_str() {
            "redis" | "valkey" => (false, false),
            "rediss" | "valkeys" => (false, true),
            "redis+cluster" | "valkey+cluster" => (true, false),
            "rediss+cluster" | "valkeys+cluster" => (true, true),
            other => {
                return Err(bad(&format!(
                    "scheme {other:?} is not one UMBP knows; use redis:// (one server), redis+cluster:// (a cluster), or rediss:// / rediss+cluster:// for TLS"
                )))
            }
        };
        let proto = if tls { "rediss" } else { "redis" };
        let (rest, insecure) = match rest
            .strip_suffix("/#insecure")
            .or_else(|| rest.strip_suffix("#insecure"))
        {
            Some(r) if tls => (r, true),
            Some(_) => return Err(bad("#insecure only applies to TLS (rediss://) URLs")),
            None => (rest, false),
        };
        let fragment = if insecure { "/#insecure" } else { "" };
        if rest.is_empty() || rest.starts_with('/') {
            return Err(bad("it names no host"));
        }
        if !cluster {
            if rest.contains(',') {
                return Err(bad(
                    "several hosts need redis+cluster://; redis:// names one server",
                ));
            }
            let u = if insecure && rest.contains('/') {
                format!("{proto}://{rest}#insecure")
            } else {
                format!("{proto}://{rest}{fragment}")
            };
            redis::parse_redis_url(&u).ok_or_else(|| bad("it is not a valid URL"))?;
            return Ok(Target::Single(u));
        }
        let (auth, hosts) = match rest.rsplit_once('@') {
            Some((a, h)) => (Some(a), h),
            None => (None, rest),
        };
        if hosts.contains('/') {
            return Err(bad(
                "a cluster has one database; drop the /db path from redis+cluster://",
            ));
        }
        let mut seeds = Vec::new();
        for h in hosts.split(',') {
            let h = h.trim();
            if h.is_empty() {
                return Err(bad("an empty host between commas"));
            }
            let u = match auth {
                Some(a) => format!("{proto}://{a}@{h}{fragment}"),
                None => format!("{proto}://{h}{fragment}"),
            };
            redis::parse_redis_url(&u)
                .ok_or_else(|| bad(&format!("seed {h:?} is not host:port")))?;
            seeds.push(u);
        }
        Ok(Target::Cluster(seeds))
    }
}

/// A client that makes connections (cheap to clone; connects nothing by itself). Values are
/// read within bounds ([`Link`]) on both kinds: a cluster's through [`ClusterReads`].
#[derive(Clone)]
pub(crate) enum Backend {
    Single(ConnectionInfo),
    Cluster {
        client: ClusterClient,
        seeds: Vec<String>,
    },
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Single(_) => "Backend::Single",
            Backend::Cluster { .. } => "Backend::Cluster",
        })
    }
}

impl Backend {
    /// `timeout` bounds each connect and each answer.
    pub(crate) fn new(target: &Target, timeout: Duration) -> Result<Backend, RemoteError> {
        let err = |e: redis::RedisError| RemoteError::Client(e.to_string());
        if target.tls() {
            // One process-wide TLS provider (ring); a second install (another tier, or the
            // host program's own) is refused harmlessly.
            let _ = rustls::crypto::ring::default_provider().install_default();
        }
        Ok(match target {
            Target::Single(u) => Backend::Single(u.as_str().into_connection_info().map_err(err)?),
            Target::Cluster(seeds) => Backend::Cluster {
                seeds: seeds.clone(),
                client: ClusterClientBuilder::new(seeds.iter().map(String::as_str))
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    // A node that is down answers nothing on any retry; the tier retries
                    // by itself, later, and never makes a lookup wait for it.
                    .retries(1)
                    .min_retry_wait(5)
                    .max_retry_wait(timeout.as_millis().min(1_000) as u64)
                    .build()
                    .map_err(err)?,
            },
        })
    }

    /// `SET key value [PX ttl]` for every pair, as one pipeline for this kind of remote. The
    /// values' bytes are copied into the pipeline here: the caller's objects may be released
    /// before it is sent.
    pub(crate) fn prepare_sets<V: redis::ToRedisArgs>(
        &self,
        items: &[(String, V)],
        ttl: Option<Duration>,
    ) -> SetBatch {
        macro_rules! fill {
            ($p:expr) => {
                for (k, v) in items {
                    let c = $p.cmd("SET").arg(k).arg(v);
                    if let Some(t) = ttl {
                        c.arg("PX")
                            .arg(u64::try_from(t.as_millis()).unwrap_or(u64::MAX));
                    }
                    c.ignore();
                }
            };
        }
        match self {
            Backend::Single(_) => {
                let mut p = redis::pipe();
                fill!(p);
                SetBatch::Single(p)
            }
            Backend::Cluster { .. } => {
                let mut p = cluster_pipe();
                fill!(p);
                SetBatch::Cluster(p)
            }
        }
    }

    pub(crate) fn connect(&self, timeout: Duration) -> RedisResult<Conn> {
        Ok(match self {
            Backend::Single(info) => Conn::Single(Link::connect_to(info, timeout)?),
            Backend::Cluster { client, seeds } => {
                let con = client.get_connection()?;
                con.set_read_timeout(Some(timeout))?;
                con.set_write_timeout(Some(timeout))?;
                Conn::Cluster(Box::new(ClusterConn {
                    reads: ClusterReads::connect(seeds, timeout)?,
                    rest: con,
                }))
            }
        })
    }
}

/// A pipeline of `SET`s, ready to send.
pub(crate) enum SetBatch {
    Single(redis::Pipeline),
    Cluster(redis::cluster::ClusterPipeline),
}

/// One live connection.
pub(crate) enum Conn {
    Single(Link),
    Cluster(Box<ClusterConn>),
}

/// A cluster: values are read by [`ClusterReads`] (bounded); writes, deletes and scans go
/// through the `redis` crate's cluster connection, whose replies carry no values (see
/// docs/remote.md).
pub(crate) struct ClusterConn {
    reads: ClusterReads,
    rest: ClusterConnection,
}

/// Whether `e` (or one of a pipeline's errors) is a `WRONGTYPE` answer.
pub(crate) fn is_wrong_type(e: &redis::RedisError) -> bool {
    e.to_string().contains("WRONGTYPE")
}

/// Whether `e` (maybe one of a pipeline's errors) says the cluster's slots moved.
pub(crate) fn is_redirect(e: &redis::RedisError) -> bool {
    if e.is_cluster_error() {
        return true;
    }
    // A pipeline's errors come as one error listing them; the sync cluster pipeline does not
    // follow redirections itself.
    let text = e.to_string();
    text.contains("Moved:") || text.contains("Ask:") || text.contains("TryAgain")
}

/// Whether `e` says the connection failed (then the remote is left alone for a while), not
/// that the remote refused a command.
pub(crate) fn is_transport(e: &redis::RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
}

impl Conn {
    /// The first `limit + 1` bytes of every key's value (`GETRANGE`, pipelined, per node on a
    /// cluster), so a value longer than `limit` shows as such without being read whole;
    /// `None` for absent keys (an absent key reads as empty, which no value is). A reply
    /// longer than `limit + 1` bytes, whatever the remote claims, is not read: an error
    /// ([`crate::resp::is_too_long`]) that leaves the connection closed.
    pub(crate) fn get_many(
        &mut self,
        keys: &[String],
        limit: u64,
    ) -> RedisResult<Vec<Option<Vec<u8>>>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        with_bulk_limit(limit.saturating_add(1), || {
            self.get_many_within(keys, limit)
        })
    }

    fn get_many_within(
        &mut self,
        keys: &[String],
        limit: u64,
    ) -> RedisResult<Vec<Option<Vec<u8>>>> {
        let got: Vec<Vec<u8>> = match self {
            Conn::Single(c) => {
                let mut p = redis::pipe();
                for k in keys {
                    p.cmd("GETRANGE").arg(k).arg(0).arg(limit);
                }
                p.query(c)?
            }
            Conn::Cluster(c) => c.reads.get_ranges(keys, limit)?,
        };
        Ok(got
            .into_iter()
            .map(|v| (!v.is_empty()).then_some(v))
            .collect())
    }

    /// [`get_many`](Self::get_many) one key at a time: for a chunk whose pipeline failed
    /// because some key holds another type than a string (`WRONGTYPE`, which fails the whole
    /// pipeline). Such a key reads as a one-byte value, which the caller rejects (not an
    /// object), and the others are read as usual.
    pub(crate) fn get_each(
        &mut self,
        keys: &[String],
        limit: u64,
    ) -> RedisResult<Vec<Option<Vec<u8>>>> {
        keys.iter()
            .map(|k| {
                let cmd = redis::cmd("GETRANGE").arg(k).arg(0).arg(limit).clone();
                let r: RedisResult<Vec<u8>> =
                    with_bulk_limit(limit.saturating_add(1), || match self {
                        Conn::Single(c) => cmd.query(c),
                        Conn::Cluster(c) => c.reads.get_range(k, limit),
                    });
                match r {
                    Err(e) if is_wrong_type(&e) => Ok(Some(vec![0])),
                    Ok(v) => Ok((!v.is_empty()).then_some(v)),
                    Err(e) => Err(e),
                }
            })
            .collect()
    }

    /// Runs a batch of `SET`s made by [`Backend::prepare_sets`].
    pub(crate) fn run_sets(&mut self, batch: &SetBatch) -> RedisResult<()> {
        match (self, batch) {
            (Conn::Single(c), SetBatch::Single(p)) => p.exec(c),
            (Conn::Cluster(c), SetBatch::Cluster(p)) => p.exec(&mut c.rest),
            _ => Err(redis::RedisError::from((
                redis::ErrorKind::Client,
                "a batch made for another kind of connection",
            ))),
        }
    }

    /// Deletes every key matching `pattern` (`SCAN MATCH` on every primary of a cluster, then
    /// `UNLINK`); returns how many. Gives up at `deadline` (a server whose `SCAN` never ends,
    /// say) with an error that says how many were deleted.
    pub(crate) fn delete_matching(&mut self, pattern: &str, deadline: Instant) -> RedisResult<u64> {
        let late = |n: u64| {
            redis::RedisError::from((
                redis::ErrorKind::Io,
                "the SCAN did not finish in time",
                format!("{n} keys deleted before the deadline"),
            ))
        };
        match self {
            Conn::Single(c) => {
                let mut n = 0u64;
                let mut cursor = 0u64;
                loop {
                    if Instant::now() >= deadline {
                        return Err(late(n));
                    }
                    let (next, keys): (u64, Vec<String>) = redis::cmd("SCAN")
                        .arg(cursor)
                        .arg("MATCH")
                        .arg(pattern)
                        .arg("COUNT")
                        .arg(1000)
                        .query(c)?;
                    if !keys.is_empty() {
                        let mut p = redis::pipe();
                        for k in &keys {
                            p.cmd("UNLINK").arg(k).ignore();
                        }
                        p.exec(c)?;
                        n += keys.len() as u64;
                    }
                    if next == 0 {
                        return Ok(n);
                    }
                    cursor = next;
                }
            }
            Conn::Cluster(c) => {
                let c = &mut c.rest;
                let nodes: String = redis::from_redis_value(c.route_command(
                    redis::cmd("CLUSTER").arg("NODES"),
                    RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
                )?)?;
                let mut n = 0u64;
                for (host, port) in crate::cluster::slot_map(&nodes).0 {
                    let mut cursor = 0u64;
                    loop {
                        if Instant::now() >= deadline {
                            return Err(late(n));
                        }
                        let v = c.route_command(
                            redis::cmd("SCAN")
                                .arg(cursor)
                                .arg("MATCH")
                                .arg(pattern)
                                .arg("COUNT")
                                .arg(1000),
                            RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                                host: host.clone(),
                                port,
                            }),
                        )?;
                        let (next, keys): (u64, Vec<String>) = redis::from_redis_value(v)?;
                        if !keys.is_empty() {
                            let mut p = cluster_pipe();
                            for k in &keys {
                                p.cmd("UNLINK").arg(k).ignore();
                            }
                            p.exec(c)?;
                            n += keys.len() as u64;
                        }
                        if next == 0 {
                            break;
                        }
                        cursor = next;
                    }
                }
                Ok(n)
            }
        }
    }

    /// `DEL` of every key (`clear`), pipelined.
    pub(crate) fn del_many(&mut self, keys: &[String]) -> RedisResult<()> {
        if keys.is_empty() {
            return Ok(());
        }
        match self {
            Conn::Single(c) => {
                let mut p = redis::pipe();
                for k in keys {
                    p.cmd("DEL").arg(k).ignore();
                }
                p.exec(c)
            }
            Conn::Cluster(c) => {
                let mut p = cluster_pipe();
                for k in keys {
                    p.cmd("DEL").arg(k).ignore();
                }
                p.exec(&mut c.rest)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        assert_eq!(
            Target::parse("redis://127.0.0.1:6379").unwrap(),
            Target::Single("redis://127.0.0.1:6379".into())
        );
        assert_eq!(
            Target::parse("valkey://u:p@h:7000/2").unwrap(),
            Target::Single("redis://u:p@h:7000/2".into())
        );
        assert_eq!(
            Target::parse("redis+cluster://:pw@a:7000,b:7001").unwrap(),
            Target::Cluster(vec![
                "redis://:pw@a:7000".into(),
                "redis://:pw@b:7001".into()
            ])
        );
        assert_eq!(
            Target::parse("rediss://:pw@h:6380").unwrap(),
            Target::Single("rediss://:pw@h:6380".into())
        );
        assert_eq!(
            Target::parse("rediss://h:6380/#insecure").unwrap(),
            Target::Single("rediss://h:6380/#insecure".into())
        );
        let c = Target::parse("rediss+cluster://a:1,b:2#insecure").unwrap();
        assert_eq!(
            c,
            Target::Cluster(vec![
                "rediss://a:1/#insecure".into(),
                "rediss://b:2/#insecure".into()
            ])
        );
        assert!(c.tls() && !Target::parse("redis://h:1").unwrap().tls());
        for (bad, says) in [
            ("localhost:6379", "no scheme"),
            ("http://h:1", "redis+cluster://"),
            ("redis://a:1,b:2", "redis+cluster://"),
            ("redis://h:1/#insecure", "only applies to TLS"),
            ("redis+cluster://a:1,,b:2", "empty host"),
            ("redis+cluster://a:1/3", "/db"),
            ("redis://", "no host"),
        ] {
            let e = Target::parse(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn refusals_redact_the_password() {
        let e = Target::parse("http://u:secret@h:1")
            .unwrap_err()
            .to_string();
        assert!(!e.contains("secret"), "{e}");
    }
}
