# The image store: s3://<bucket>/<job>/chunks/... and <job>/images/<id>/manifest.json
# (src/spotguard/contracts.py). One prefix per job, so each agent role reaches only its own.
resource "aws_s3_bucket" "images" {
  #checkov:skip=CKV_AWS_144:Checkpoint images are short-lived restart points of running jobs, re-created every checkpoint; a second region's copy would double cost for data that is stale within hours. Deploy the module in a second region for regional failover instead.
  #checkov:skip=CKV2_AWS_62:Nothing consumes object-created events: the controller learns of new images from agent reports (POST /v1/events) and reads manifests on demand.
  #checkov:skip=CKV_AWS_18:Access logging is available through var.access_log_bucket (the log bucket must exist outside this module); it is off by default because the example creates no log bucket.
  bucket        = local.bucket_name
  force_destroy = var.force_destroy
  tags          = local.tags
}

resource "aws_s3_bucket_ownership_controls" "images" {
  bucket = aws_s3_bucket.images.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

resource "aws_s3_bucket_public_access_block" "images" {
  bucket                  = aws_s3_bucket.images.id
  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

resource "aws_s3_bucket_versioning" "images" {
  bucket = aws_s3_bucket.images.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_server_side_encryption_configuration" "images" {
  bucket = aws_s3_bucket.images.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    bucket_key_enabled = true
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "images" {
  bucket = aws_s3_bucket.images.id

  # A checkpoint cut off mid-upload leaves parts behind; they are never part of an image.
  rule {
    id     = "abort-unfinished-uploads"
    status = "Enabled"

    filter {}

    abort_incomplete_multipart_upload {
      days_after_initiation = var.abort_multipart_days
    }
  }

  # Garbage-collected chunks and replaced manifests stay recoverable for a few days.
  rule {
    id     = "expire-old-versions"
    status = "Enabled"

    filter {}

    noncurrent_version_expiration {
      noncurrent_days = var.noncurrent_version_days
    }

    expiration {
      expired_object_delete_marker = true
    }
  }

  dynamic "rule" {
    for_each = var.chunk_expiration_days > 0 ? keys(var.jobs) : []

    content {
      id     = "expire-chunks-${rule.value}"
      status = "Enabled"

      filter {
        prefix = "${rule.value}/chunks/"
      }

      expiration {
        days = var.chunk_expiration_days
      }
    }
  }

  depends_on = [aws_s3_bucket_versioning.images]
}

resource "aws_s3_bucket_logging" "images" {
  count = var.access_log_bucket == null ? 0 : 1

  bucket        = aws_s3_bucket.images.id
  target_bucket = var.access_log_bucket
  target_prefix = "${local.bucket_name}/"
}

data "aws_iam_policy_document" "bucket" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.images.arn,
      "${aws_s3_bucket.images.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }
}

resource "aws_s3_bucket_policy" "images" {
  bucket = aws_s3_bucket.images.id
  policy = data.aws_iam_policy_document.bucket.json

  depends_on = [aws_s3_bucket_public_access_block.images]
}
