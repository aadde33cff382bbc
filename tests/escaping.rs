//! Input text echoed into an error (safetensors tensor names, field and metadata keys and
//! values, config.json's `model_type` and values, brace patterns, training configurations) is
//! escaped by the one rule of `fsdpturbo::error::Escaped`: no raw control character, line or
//! paragraph separator, bidi or other format character reaches a message, and the text after
//! one is kept (a NUL once cut the Python message short).

use fsdpturbo::config::parse_train_config_bytes;
use fsdpturbo::pattern::Pattern;
use fsdpturbo::safetensors::parse_header;
use fsdpturbo::spec::{SpecRegistry, model_tree_from_config};
use serde_json::json;

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
