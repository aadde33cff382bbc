//! Input text echoed into an error (safetensors tensor names, field and metadata keys and
//! values, config.json's `model_type` and values, brace patterns, training configurations, and
//! the names a C caller passes: tensor names to a read plan, topology dims) is
//! escaped by the one rule of `fsdpturbo::error::Escaped`: no raw control character, line or
//! paragraph separator, bidi or other format character reaches a message, and the text after
//! one is kept (a NUL once cut the Python message short).

use std::ffi::{CString, c_char};

use fsdpturbo::config::parse_train_config_bytes;
use fsdpturbo::ffi::placement::{FSDPTURBO_PLACEMENT_REPLICATE, fsdpturbo_placement_t};
use fsdpturbo::ffi::safetensors::*;
use fsdpturbo::ffi::status::{FSDPTURBO_ERR_INVALID_ARGUMENT, FSDPTURBO_ERR_NOT_FOUND, FSDPTURBO_OK};
use fsdpturbo::ffi::topology::*;
use fsdpturbo::pattern::Pattern;
use fsdpturbo::safetensors::parse_header;
use fsdpturbo::spec::{SpecRegistry, model_tree_from_config};
use serde_json::json;

mod common;
use common::{last_error, topology_options};

/// Each breaks or disguises a one-line message: a line break that forges a log line, the
/// Unicode line separator, a right-to-left override, a NUL, a bidi isolate and a zero-width space.
const HOSTILE: &[&str] =
    &["a\nINFO forged", "a\u{2028}INFO forged", "a\u{202e}forged", "a\u{0}forged", "a\u{2066}forged\u{200b}"];

fn is_raw_hazard(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{61c}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}'
            | '\u{2066}'..='\u{2069}' | '\u{feff}')
}

fn assert_escaped(message: &str, what: &str) {
    assert!(!message.chars().any(is_raw_hazard), "{what}: raw hazard in {message:?}");
    assert!(message.contains("forged"), "{what}: the text after the hazard is lost in {message:?}");
}

fn header(json: &str) -> Vec<u8> {
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out
}

fn header_error(json: &str) -> String {
    parse_header(&header(json), None).expect_err("must be refused").message
}

#[test]
fn safetensors_errors_escape_names_keys_and_values() {
    for &text in HOSTILE {
        let name = serde_json::to_string(text).unwrap();
        let cases = [
            format!(r#"{{{name}:{{"dtype":"X","shape":[1],"data_offsets":[0,1]}}}}"#),
            format!(r#"{{"t":{{"dtype":"F32","shape":[1],"data_offsets":[0,4],{name}:1}}}}"#),
            format!(r#"{{"t":{{"dtype":{name},"shape":[1],"data_offsets":[0,4]}}}}"#),
            format!(r#"{{"t":{{"dtype":"F32","shape":[{name}],"data_offsets":[0,4]}}}}"#),
            format!(r#"{{"t":{name}}}"#),
            format!(r#"{{"__metadata__":{{{name}:1}}}}"#),
            format!(r#"{{"__metadata__":{name}}}"#),
            format!(
                r#"{{{name}:{{"dtype":"F32","shape":[1],"data_offsets":[0,4]}},"u":{{"dtype":"F32","shape":[1],"data_offsets":[2,6]}}}}"#
            ),
        ];
        for json in cases {
            assert_escaped(&header_error(&json), &json);
        }
    }
}

#[test]
fn model_type_and_config_json_values_are_escaped() {
    for &text in HOSTILE {
        assert_escaped(&SpecRegistry::with_builtins().get(text).unwrap_err().message, "registry");
        assert_escaped(
            &model_tree_from_config(&json!({"model_type": text})).unwrap_err().message,
            "tree builder",
        );
        let config = json!({"model_type": "qwen3_moe", "hidden_size": text});
        assert_escaped(&model_tree_from_config(&config).unwrap_err().message, "config value");
    }
}

#[test]
fn brace_patterns_are_escaped() {
    for &text in HOSTILE {
        assert_escaped(&Pattern::compile(&format!("layers.{{{text}}}")).unwrap_err().message, "pattern");
    }
}

#[test]
fn training_configuration_errors_escape_separators_and_bidi_characters() {
    for &text in HOSTILE {
        let escapes: String = text
            .chars()
            .map(|c| if c.is_ascii_graphic() { c.to_string() } else { format!("\\u{:04x}", c as u32) })
            .collect();
        let value = format!("\"{escapes}\"");
        let yaml = format!("dist_config:\n  name: fsdpturbo\n  ep_dispatcher: {value}\n  {value}: 1\n");
        let errors = parse_train_config_bytes(yaml.as_bytes()).unwrap_err();
        assert_eq!(errors.0.len(), 2, "{errors}");
        for error in &errors.0 {
            assert_escaped(&error.to_string(), &yaml);
        }
    }
}

/// Names a C caller can pass (no NUL): a line break that forges a log line, an escape sequence
/// (a control character that is not a line break), a right-to-left override, a line separator;
/// and how each is echoed.
const C_HOSTILE: &[(&str, &str)] = &[
    ("a\nINFO forged", "a\\nINFO forged"),
    ("a\u{1b}[2Kforged", "a\\u{1b}[2Kforged"),
    ("a\u{202e}forged", "a\\u{202e}forged"),
    ("a\u{2028}forged", "a\\u{2028}forged"),
];

/// A safetensors file of one F32 tensor of one element named `name`, parsed by the C ABI.
fn parsed_file(name: &str) -> *mut fsdpturbo_safetensors_t {
    let mut json = format!(
        r#"{{{}:{{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}}}"#,
        serde_json::to_string(name).unwrap()
    );
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.extend_from_slice(&[0; 4]);
    let mut file = std::ptr::null_mut();
    let status = fsdpturbo_safetensors_parse(bytes.as_ptr(), bytes.len(), bytes.len() as u64, &mut file);
    assert_eq!(status, FSDPTURBO_OK, "{}", last_error());
    file
}

/// fsdpturbo_safetensors_read_plan_new for the tensor `name` of shape [1] on one rank.
fn read_plan_status(files: &[*const fsdpturbo_safetensors_t], name: &CString) -> i32 {
    let names: [*const c_char; 1] = [name.as_ptr()];
    let replicate = fsdpturbo_placement_t { kind: FSDPTURBO_PLACEMENT_REPLICATE, dim: 0, split_factor: 0 };
    let mut plan = std::ptr::null_mut();
    let status = fsdpturbo_safetensors_read_plan_new(
        files.as_ptr(),
        files.len(),
        names.as_ptr(),
        1,
        0,
        [1u64].as_ptr(),
        1,
        [1u64].as_ptr(),
        1,
        &replicate,
        0,
        &mut plan,
    );
    fsdpturbo_read_plan_free(plan);
    status
}

#[test]
fn tensor_names_from_a_c_caller_are_escaped() {
    for &(name, shown) in C_HOSTILE {
        let c_name = CString::new(name).unwrap();
        let other = parsed_file("other");
        assert_eq!(read_plan_status(&[other.cast_const()], &c_name), FSDPTURBO_ERR_NOT_FOUND as i32);
        let message = last_error();
        assert_eq!(message, format!("tensor `{shown}` is in none of the 1 files given"));
        assert_escaped(&message, name);

        let file = parsed_file(name);
        let twice = [file.cast_const(), file.cast_const()];
        assert_eq!(read_plan_status(&twice, &c_name), FSDPTURBO_ERR_INVALID_ARGUMENT as i32);
        let message = last_error();
        assert_eq!(
            message,
            format!("tensor `{shown}` is in files[0] and files[1]; a checkpoint holds each tensor once")
        );
        assert_escaped(&message, name);
        assert_eq!(read_plan_status(&[file.cast_const()], &c_name), FSDPTURBO_OK, "{}", last_error());
        fsdpturbo_safetensors_free(file);
        fsdpturbo_safetensors_free(other);
    }
}

#[test]
fn topology_dims_from_a_c_caller_are_escaped() {
    let mut topology = std::ptr::null_mut();
    assert_eq!(fsdpturbo_topology_new(&topology_options(8, 1, 2), &mut topology), FSDPTURBO_OK);
    let (mut size, mut members, mut n) = (0u64, [0u64; 8], 0usize);
    for &(name, shown) in C_HOSTILE {
        let dim = CString::new(name).unwrap();
        assert_eq!(
            fsdpturbo_topology_size(topology, dim.as_ptr(), &mut size),
            FSDPTURBO_ERR_INVALID_ARGUMENT
        );
        let message = last_error();
        assert!(message.starts_with(&format!("argument `dim` is \"{shown}\", which is not")), "{message}");
        assert_escaped(&message, name);

        let group = |dims: &CString, members: &mut [u64; 8], n: &mut usize| {
            fsdpturbo_topology_group(
                topology,
                FSDPTURBO_MESH_EXPERT,
                dims.as_ptr(),
                0,
                members.as_mut_ptr(),
                8,
                n,
            )
        };
        assert_eq!(group(&dim, &mut members, &mut n), FSDPTURBO_ERR_INVALID_ARGUMENT);
        let message = last_error();
        assert!(message.contains(&format!("has no dim named \"{shown}\"; its dims are")), "{message}");
        assert_escaped(&message, name);

        let empty = CString::new(format!("ep,,{name}")).unwrap();
        assert_eq!(group(&empty, &mut members, &mut n), FSDPTURBO_ERR_INVALID_ARGUMENT);
        let message = last_error();
        assert!(message.starts_with(&format!("argument `dims` is \"ep,,{shown}\"; it must be")), "{message}");
        assert_escaped(&message, name);
    }
    fsdpturbo_topology_free(topology);
}
