use super::schema::*;
use super::text::*;
use super::*;

fn lines(text: &str) -> HashMap<String, usize> {
    Lines::index(text, Vec::new()).lines.0.into_iter().map(|(k, v)| (Path(k).to_string(), v)).collect()
}

#[test]
fn line_index_block_and_flow() {
    let l = lines("a: 1\nb:\n  c: [x,\n    y]\n  d: {e: 1,\n   f: 2}\ng:\n  - h\n  - i: 3\n");
    assert_eq!(l["a"], 1);
    assert_eq!(l["b"], 2);
    assert_eq!(l["b.c"], 3);
    assert_eq!(l["b.c[0]"], 3);
    assert_eq!(l["b.c[1]"], 4);
    assert_eq!(l["b.d.e"], 5);
    assert_eq!(l["b.d.f"], 6);
    assert_eq!(l["g[0]"], 8);
    assert_eq!(l["g[1]"], 9);
    assert_eq!(l["g[1].i"], 9);
}

#[test]
fn line_index_skips_complex_keys_and_keeps_counting() {
    let l = lines("? [k, l]\n: {m: 1}\nn: 2\n");
    assert_eq!(l.get("m"), None);
    assert_eq!(l["n"], 3);
    assert_eq!(l.len(), 1);
}

#[test]
fn line_index_reports_repeated_keys() {
    let index = Lines::index("a: 1\nb: {c: 1}\nb: 2\n", Vec::new());
    assert_eq!(index.duplicates, vec![(vec![Seg::Key("b".into())], 2, 3)]);
}

#[test]
fn fragment_root_gets_the_base_path() {
    let l = Lines::index("\n{ep_size: 2}", vec![Seg::Key("dist_config".into())]).lines;
    assert_eq!(l.of(&[Seg::Key("dist_config".into())]), Some(2));
    assert_eq!(l.of(&[Seg::Key("dist_config".into()), Seg::Key("ep_size".into())]), Some(2));
    assert_eq!(l.of(&[Seg::Key("dist_config".into()), Seg::Key("nope".into())]), Some(2));
}

#[test]
fn nesting_beyond_the_limit_stops_the_pass() {
    let ok = format!("{}{}", "[".repeat(MAX_NESTING), "]".repeat(MAX_NESTING));
    assert_eq!(Lines::index(&ok, Vec::new()).refused, None);
    let deep = format!("a:\n {}{}", "[".repeat(MAX_NESTING), "]".repeat(MAX_NESTING));
    let refused = Lines::index(&deep, Vec::new()).refused;
    assert_eq!(refused, Some((2, "the YAML nests deeper than 128 levels".to_string())));
}

#[test]
fn alias_expansion_is_counted_through_nested_anchors() {
    // &a is 4 nodes (the list and 3 items); &b holds two aliases of it: 1 + 8 = 9 nodes.
    let text = "a: &a [x, y, z]\nb: &b [*a, *a]\nc: *b\n";
    assert_eq!(Lines::index(text, Vec::new()).refused, None);
    let uses =
        |n: usize| format!("a: &a [{}]\nb: [{}]\n", vec!["x"; 99].join(", "), vec!["*a"; n].join(", "));
    assert_eq!(Lines::index(&uses(100), Vec::new()).refused, None); // 100 * 100 nodes
    let refused = Lines::index(&uses(101), Vec::new()).refused;
    assert_eq!(refused, Some((2, "the YAML's aliases expand to more than 10000 nodes".to_string())));
}

#[test]
fn recursive_aliases_are_refused_and_redefinitions_followed() {
    let refused = |text: &str| Lines::index(text, Vec::new()).refused.map(|r| r.1);
    assert_eq!(refused("a: &a [x, *a]\n").as_deref(), Some("the alias *a is inside the node it names"));
    assert_eq!(refused("a: &a {b: {c: *a}}\n").as_deref(), Some("the alias *a is inside the node it names"));
    // The inner node took the name over before the alias: not recursive.
    assert_eq!(refused("a: &a [&a x, *a]\n"), None);
    assert_eq!(
        refused("a: &a [x]\nb: &a [*a]\n").as_deref(),
        Some("the alias *a is inside the node it names")
    );
    assert_eq!(refused("a: &a [x]\nb: [*a, *a]\nc: &a y\nd: *a\n"), None);
}

#[test]
fn python_reprs() {
    assert_eq!(py_float(48.0), "48.0");
    assert_eq!(py_float(2.5), "2.5");
    assert_eq!(py_float(1e16), "1e+16");
    assert_eq!(py_float(1.2345678901234568e29), "1.2345678901234568e+29");
    assert_eq!(py_float(0.0001), "0.0001");
    assert_eq!(py_float(0.00001), "1e-05");
    assert_eq!(py_float(-0.0), "-0.0");
    assert_eq!(py_str("it's"), "\"it's\"");
    assert_eq!(py_str("a'b\"c"), "'a\\'b\"c'");
    assert_eq!(py_str("tab\there\u{1}"), "'tab\\there\\x01'");
    assert_eq!(
        py_repr(&serde_yaml::from_str("[1, x, null, true, 2.0]").unwrap()),
        "[1, 'x', None, True, 2.0]"
    );
}

#[test]
fn string_coercion_follows_convert_str_dict() {
    assert_eq!(convert_str("TrUe"), Value::Bool(true));
    assert_eq!(convert_str("FALSE"), Value::Bool(false));
    assert_eq!(convert_str("0042"), Value::from(42u64));
    assert_eq!(convert_str("1.5"), Value::from(1.5));
    assert_eq!(convert_str(".5"), Value::from(0.5));
    assert_eq!(convert_str("5."), Value::from(5.0));
    assert_eq!(convert_str("1.2.3"), Value::from("1.2.3"));
    assert_eq!(convert_str("-1"), Value::from("-1"));
    assert_eq!(convert_str("."), Value::from("."));
    assert_eq!(convert_str(""), Value::from(""));
    assert_eq!(convert_str("１２"), Value::from("１２"));
    assert!(matches!(convert_str("99999999999999999999999"), Value::Number(n) if n.is_f64()));
}

#[test]
fn edit_distance_counts_edits() {
    assert_eq!(edit_distance("ep_sise", "ep_size"), 1);
    assert_eq!(edit_distance("", "abc"), 3);
    assert_eq!(
        did_you_mean("hook_module", &DIST_FIELDS).as_deref(),
        Some("`hook_module`: did you mean `hook_modules`?")
    );
    assert_eq!(did_you_mean("zzz", &DIST_FIELDS), None);
}

#[test]
fn without_a_dist_config_every_dist_config_key_is_serialised_with_its_default() {
    let json = serde_json::to_value(parse_train_config("model: m\n").unwrap()).unwrap();
    let dist = json["dist"].as_object().expect("`dist` is a mapping");
    let mut keys: Vec<&str> = dist.keys().map(String::as_str).collect();
    let mut expected = DIST_FIELDS.to_vec();
    keys.sort_unstable();
    expected.sort_unstable();
    assert_eq!(keys, expected);
    assert_eq!(json["dist"], serde_json::to_value(DistConfig::default()).unwrap());
}

#[test]
fn every_dist_config_field_at_the_top_level_belongs_inside_dist_config() {
    for field in DIST_FIELDS.iter().filter(|&&field| field != "name") {
        let yaml = format!("model: m\n{field}: 4\ndist_config: {{name: fsdpturbo}}\n");
        let Err(ConfigErrors(errors)) = parse_train_config(&yaml) else {
            panic!("expected {yaml:?} to fail");
        };
        let [e] = errors.as_slice() else { panic!("expected one error, got {errors:#?}") };
        assert_eq!((e.path.as_str(), e.line), (*field, Some(2)), "{e}");
        assert!(e.message.contains(&format!("`{field}` is a dist_config (FSDPTurboParams) field")), "{e}");
        assert!(e.message.contains("move it inside dist_config"), "{e}");
    }
}
