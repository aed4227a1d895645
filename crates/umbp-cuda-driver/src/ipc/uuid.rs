//! Finding a device by its UUID: ordinals differ between processes with different
//! `CUDA_VISIBLE_DEVICES`, UUIDs do not.

use crate::error::CudaError;
use crate::result::{self, context};

/// `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, as `nvidia-smi -L` writes a device's UUID.
pub fn format_uuid(uuid: &[u8; 16]) -> String {
    let h: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// The ordinal, in this process, of the device with UUID `uuid`.
pub fn device_by_uuid(uuid: &[u8; 16]) -> Result<i32, CudaError> {
    let drv = result::driver()?;
    let count = context::device_get_count(drv)?;
    let mut seen = Vec::new();
    for i in 0..count {
        let d = context::device_get(drv, i)?;
        let u = context::device_get_uuid(drv, d)?;
        if &u == uuid {
            return Ok(i);
        }
        seen.push(format!("{i}: {}", format_uuid(&u)));
    }
    Err(CudaError::UnknownDevice {
        uuid: format_uuid(uuid),
        seen: if seen.is_empty() {
            "no device".into()
        } else {
            seen.join(", ")
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_are_written_as_nvidia_smi_does() {
        let u: [u8; 16] = std::array::from_fn(|i| (i as u8) * 17);
        assert_eq!(format_uuid(&u), "GPU-00112233-4455-6677-8899-aabbccddeeff");
    }
}
