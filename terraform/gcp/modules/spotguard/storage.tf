# The image store: gs://<bucket>/<job>/chunks/... and <job>/images/<id>/manifest.json
# (src/spotguard/contracts.py). One prefix per job, so each agent account reaches only its own.
resource "google_storage_bucket" "images" {
  #checkov:skip=CKV_GCP_62:Usage logging is available through var.access_log_bucket (the log bucket must exist outside this module); off by default because the example creates none. Data Access audit logs cover object reads and writes.
  project                     = var.project_id
  name                        = local.bucket_name
  location                    = upper(var.region)
  force_destroy               = var.force_destroy
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  labels                      = local.labels

  versioning {
    enabled = true
  }

  dynamic "encryption" {
    for_each = var.kms_key_name == null ? [] : [var.kms_key_name]

    content {
      default_kms_key_name = encryption.value
    }
  }

  dynamic "logging" {
    for_each = var.access_log_bucket == null ? [] : [var.access_log_bucket]

    content {
      log_bucket        = logging.value
      log_object_prefix = local.bucket_name
    }
  }

  # A checkpoint cut off mid-upload leaves parts behind; they are never part of an image.
  lifecycle_rule {
    condition {
      age = var.abort_multipart_days
    }
    action {
      type = "AbortIncompleteMultipartUpload"
    }
  }

  # Garbage-collected chunks and replaced manifests stay recoverable for a few days.
  lifecycle_rule {
    condition {
      days_since_noncurrent_time = var.noncurrent_version_days
      with_state                 = "ARCHIVED"
    }
    action {
      type = "Delete"
    }
  }

  dynamic "lifecycle_rule" {
    for_each = var.chunk_expiration_days > 0 ? [1] : []

    content {
      condition {
        age            = var.chunk_expiration_days
        matches_prefix = [for job in keys(var.jobs) : "${job}/chunks/"]
      }
      action {
        type = "Delete"
      }
    }
  }
}
