//! Where the Ascend libraries are found and which operator version is used, in a process of its
//! own (it loads a libopapi without aclnnGroupedMatmulV5): `$ASCEND_HOME_PATH/lib64`, op-plugin's
//! search order, and the V5 → V4 fallback, which then runs the same protocol.

mod doubles;

use fsdpturbo::backend::ascend::acl::{ACL_FLOAT, ACL_INT64, Acl};
use fsdpturbo::backend::ascend::aclnn::{Aclnn, View};
use fsdpturbo::backend::ascend::hccl::Hccl;

#[test]
fn ascend_home_path_lib64_and_the_op_plugin_search_order() {
    let _g = doubles::lock();
    let d = doubles::dir();
    let home = d.join("ascend_home");
    let lib64 = home.join("lib64");
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&lib64).unwrap();
    for name in ["libascendcl.so", "libhccl.so", "libopapi.so", "libnnopbase.so"] {
        std::os::unix::fs::symlink(d.join(name), lib64.join(name)).unwrap();
    }
    // A vendor operator library (searched before libopapi.so) without grouped matmul V5.
    std::os::unix::fs::symlink(d.join("v4only/libopapi.so"), lib64.join("libopapi_vendor.so")).unwrap();
    // SAFETY: under the lock.
    unsafe {
        for var in
            ["FSDPTURBO_ACL_PATH", "FSDPTURBO_HCCL_PATH", "FSDPTURBO_OPAPI_PATH", "FSDPTURBO_NNOPBASE_PATH"]
        {
            std::env::remove_var(var);
        }
        std::env::set_var("ASCEND_HOME_PATH", &home);
    }
    assert_eq!(Acl::load().unwrap().lib.path(), lib64.join("libascendcl.so"));
    assert_eq!(Hccl::load().unwrap().lib.path(), lib64.join("libhccl.so"));
    let aclnn = Aclnn::load().unwrap();
    let paths: Vec<_> = aclnn.libs.iter().map(|l| l.path().to_path_buf()).collect();
    assert_eq!(
        paths,
        [lib64.join("libopapi_vendor.so"), lib64.join("libopapi.so"), lib64.join("libnnopbase.so")]
    );
    assert_eq!(aclnn.grouped_mm.version(), 5, "V5 is taken from the first library that has it");
    unsafe { std::env::remove_var("ASCEND_HOME_PATH") };
}

#[test]
fn without_v5_grouped_mm_falls_back_to_v4() {
    let _g = doubles::lock();
    doubles::use_doubles(&doubles::dir().join("v4only/libopapi.so"));
    let log = doubles::fresh_log("v4");
    let api = Aclnn::get().unwrap();
    assert_eq!(api.grouped_mm.version(), 4);
    let acl = Acl::get().unwrap();
    let mut stream = std::ptr::null_mut();
    assert_eq!(unsafe { (acl.create_stream)(&mut stream) }, 0);
    let mut x = [1f32, 2.0, 3.0, 4.0];
    let mut w = [1f32, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 2.0];
    let mut counts = [1i64, 1];
    let mut y = [0f32; 4];
    let view = |dims: &'static [i64], strides: &'static [i64], data: *mut f32, len: usize| View {
        dtype: ACL_FLOAT,
        dims,
        strides,
        offset: 0,
        storage_len: len as i64,
        storage: data.cast(),
    };
    let mut buffers = Vec::new();
    unsafe {
        api.grouped_mm(
            &view(&[2, 2], &[2, 1], x.as_mut_ptr(), 4),
            &view(&[2, 2, 2], &[4, 2, 1], w.as_mut_ptr(), 8),
            &View {
                dtype: ACL_INT64,
                dims: &[2],
                strides: &[1],
                offset: 0,
                storage_len: 2,
                storage: counts.as_mut_ptr().cast(),
            },
            &view(&[2, 2], &[2, 1], y.as_mut_ptr(), 4),
            2,
            0,
            &mut |b| {
                buffers.push(vec![0u8; b as usize]);
                Ok(buffers.last_mut().unwrap().as_mut_ptr().cast())
            },
            stream,
        )
    }
    .unwrap();
    assert_eq!(y, [1.0, 2.0, 6.0, 8.0]);
    let lines = doubles::read_log(&log);
    assert!(lines.iter().any(|l| l.starts_with("aclnnGroupedMatmulV4GetWorkspaceSize ")), "{lines:?}");
    assert!(lines.iter().any(|l| l.starts_with("aclnnGroupedMatmulV4 workspace=384 ")), "{lines:?}");
    assert!(!lines.iter().any(|l| l.contains("V5") || l.starts_with("VIOLATION")), "{lines:?}");
}
