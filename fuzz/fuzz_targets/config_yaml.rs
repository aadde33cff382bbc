//! Feeds arbitrary bytes to the configuration parser, directly and through the C ABI: it must
//! never panic, an error result lists every error one per line, and a parsed configuration
//! serialises to JSON.
#![no_main]

use std::ptr;

use fsdpturbo::config::{ConfigErrors, parse_dist_config, parse_kernel_config, parse_train_config_bytes};
use fsdpturbo::ffi::config::{fsdpturbo_config_free, fsdpturbo_config_parse, fsdpturbo_config_to_json};
use fsdpturbo::ffi::status::{FSDPTURBO_ERR_BUFFER_TOO_SMALL, FSDPTURBO_ERR_CONFIG, FSDPTURBO_OK};
use libfuzzer_sys::fuzz_target;

fn check_errors<T>(result: Result<T, ConfigErrors>) {
    if let Err(errors) = result {
        assert!(!errors.0.is_empty(), "an error result lists at least one error");
        assert_eq!(errors.to_string().lines().count(), errors.0.len(), "one line per error:\n{errors}");
    }
}

fuzz_target!(|data: &[u8]| {
    let parsed = parse_train_config_bytes(data);
    let ok = parsed.is_ok();
    check_errors(parsed);
    if let Ok(text) = std::str::from_utf8(data) {
        check_errors(parse_dist_config(text));
        check_errors(parse_kernel_config(text));
    }

    let mut config = ptr::null_mut();
    let status = fsdpturbo_config_parse(data.as_ptr().cast(), data.len(), &mut config);
    assert_eq!(status, if ok { FSDPTURBO_OK } else { FSDPTURBO_ERR_CONFIG });
    if ok {
        let mut needed = 0usize;
        assert_eq!(fsdpturbo_config_to_json(config, ptr::null_mut(), 0, &mut needed), FSDPTURBO_ERR_BUFFER_TOO_SMALL);
        let mut buf = vec![0u8; needed];
        let mut len = 0usize;
        assert_eq!(fsdpturbo_config_to_json(config, buf.as_mut_ptr().cast(), buf.len(), &mut len), FSDPTURBO_OK);
        assert_eq!(buf.last(), Some(&0));
    }
    fsdpturbo_config_free(config);
});
