//! Each key's [`KeyOutcome`] on the wire, both ways: the server writes a transfer's outcomes
//! with [`encode`], the client reads them back with [`decode`]. A key's status is one byte of
//! [`v1::KeyStatus`]; a failed key also has a [`v1::KeyError`] that names its
//! [`FailureKind`] and says why.

use umbp_core::{FailureKind, KeyFailure, KeyOutcome};

use crate::v1;

/// The wire status of one key's outcome. A key cancelled because its transfer's deadline
/// passed (`timed_out`) reads as timed out, and so does one still pending.
pub fn status_of(outcome: &KeyOutcome, timed_out: bool) -> v1::KeyStatus {
    use v1::KeyStatus as S;
    match outcome {
        KeyOutcome::Pending | KeyOutcome::TimedOut => S::TimedOut,
        KeyOutcome::Done => S::Done,
        KeyOutcome::AlreadyPresent => S::AlreadyPresent,
        KeyOutcome::Missing => S::Missing,
        KeyOutcome::PoolFull => S::PoolFull,
        KeyOutcome::Cancelled if timed_out => S::TimedOut,
        KeyOutcome::Cancelled => S::Cancelled,
        KeyOutcome::Failed(_) => S::Failed,
        KeyOutcome::Skipped => S::Skipped,
    }
}

/// A transfer's outcomes as the reply's `statuses` (one byte per key) and `errors` (one per
/// failed key, in key order).
pub fn encode(outcomes: &[KeyOutcome], timed_out: bool) -> (Vec<u8>, Vec<v1::KeyError>) {
    let mut statuses = Vec::with_capacity(outcomes.len());
    let mut errors = Vec::new();
    for (i, outcome) in outcomes.iter().enumerate() {
        statuses.push(status_of(outcome, timed_out) as u8);
        if let KeyOutcome::Failed(f) = outcome {
            errors.push(v1::KeyError {
                index: i as u32,
                kind: f.kind.name().into(),
                message: f.message.clone(),
            });
        }
    }
    (statuses, errors)
}

/// The outcomes of `n` keys from a reply's `statuses` and `errors`; `Err` says how the reply
/// is malformed (a count that is not `n`, a status byte or failure kind this end does not
/// know, an error for a key that is not there).
pub fn decode(
    statuses: &[u8],
    errors: Vec<v1::KeyError>,
    n: usize,
) -> Result<Vec<KeyOutcome>, String> {
    use v1::KeyStatus as S;
    if statuses.len() != n {
        return Err(format!(
            "the server answered {} statuses for {n} keys",
            statuses.len()
        ));
    }
    let mut out = Vec::with_capacity(n);
    for &b in statuses {
        out.push(match S::try_from(b as i32) {
            Ok(S::Done) => KeyOutcome::Done,
            Ok(S::AlreadyPresent) => KeyOutcome::AlreadyPresent,
            Ok(S::Missing) => KeyOutcome::Missing,
            Ok(S::PoolFull) => KeyOutcome::PoolFull,
            Ok(S::Cancelled) => KeyOutcome::Cancelled,
            Ok(S::TimedOut) => KeyOutcome::TimedOut,
            Ok(S::Skipped) => KeyOutcome::Skipped,
            // Its kind and message come in `errors`; a failed key without one is a device
            // failure the server did not explain.
            Ok(S::Failed) => KeyOutcome::failed(FailureKind::Device, ""),
            _ => return Err(format!("the server answered key status {b}")),
        });
    }
    for e in errors {
        let kind = FailureKind::from_name(&e.kind).ok_or_else(|| {
            format!(
                "the server named key failure {:?}, which this client does not know",
                e.kind
            )
        })?;
        let slot = out
            .get_mut(e.index as usize)
            .ok_or_else(|| format!("the server sent an error for key {} of {n}", e.index))?;
        *slot = KeyOutcome::Failed(KeyFailure::new(kind, e.message));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_outcome() -> Vec<KeyOutcome> {
        vec![
            KeyOutcome::Done,
            KeyOutcome::AlreadyPresent,
            KeyOutcome::Missing,
            KeyOutcome::PoolFull,
            KeyOutcome::Cancelled,
            KeyOutcome::TimedOut,
            KeyOutcome::Skipped,
            KeyOutcome::failed(FailureKind::Device, "the copy engine faulted"),
            KeyOutcome::failed(FailureKind::Server, "the server went away"),
        ]
    }

    #[test]
    fn every_outcome_reads_back_as_written() {
        let outcomes = every_outcome();
        let (statuses, errors) = encode(&outcomes, false);
        assert_eq!(errors.len(), 2);
        assert_eq!(decode(&statuses, errors, outcomes.len()).unwrap(), outcomes);
    }

    #[test]
    fn a_deadline_turns_cancelled_and_pending_keys_into_timed_out() {
        let (statuses, errors) = encode(&[KeyOutcome::Cancelled, KeyOutcome::Pending], true);
        assert_eq!(
            decode(&statuses, errors, 2).unwrap(),
            vec![KeyOutcome::TimedOut; 2]
        );
        let (statuses, _) = encode(&[KeyOutcome::Cancelled], false);
        assert_eq!(statuses, vec![v1::KeyStatus::Cancelled as u8]);
    }

    #[test]
    fn malformed_replies_say_what_is_wrong() {
        let e = decode(&[0], Vec::new(), 2).unwrap_err();
        assert!(e.contains("1 statuses for 2 keys"), "{e}");
        let e = decode(&[250], Vec::new(), 1).unwrap_err();
        assert!(e.contains("key status 250"), "{e}");
        let (statuses, mut errors) = encode(&every_outcome()[7..8], false);
        errors[0].kind = "cosmic_ray".into();
        let e = decode(&statuses, errors, 1).unwrap_err();
        assert!(e.contains("cosmic_ray"), "{e}");
        let (statuses, mut errors) = encode(&every_outcome()[7..8], false);
        errors[0].index = 7;
        let e = decode(&statuses, errors, 1).unwrap_err();
        assert!(e.contains("key 7 of 1"), "{e}");
    }
}
