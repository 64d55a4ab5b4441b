# Fleet mode: EC2 interruption events reach the controller through an encrypted queue, so a job
# is recovered even when its agent died with the VM. The patterns live in event-patterns.json,
# which spotguard.notices.fleet's tests load too.
resource "aws_sqs_queue" "events_dlq" {
  name                              = "${var.name}-events-dlq"
  message_retention_seconds         = 1209600
  kms_master_key_id                 = aws_kms_key.this.arn
  kms_data_key_reuse_period_seconds = 300
  tags                              = local.tags
}

resource "aws_sqs_queue" "events" {
  name                              = "${var.name}-events"
  message_retention_seconds         = var.queue_retention_seconds
  receive_wait_time_seconds         = 20
  visibility_timeout_seconds        = 60
  kms_master_key_id                 = aws_kms_key.this.arn
  kms_data_key_reuse_period_seconds = 300

  redrive_policy = jsonencode({
    deadLetterTargetArn = aws_sqs_queue.events_dlq.arn
    maxReceiveCount     = var.max_receive_count
  })

  tags = local.tags
}

resource "aws_sqs_queue_redrive_allow_policy" "events_dlq" {
  queue_url = aws_sqs_queue.events_dlq.id

  redrive_allow_policy = jsonencode({
    redrivePermission = "byQueue"
    sourceQueueArns   = [aws_sqs_queue.events.arn]
  })
}

data "aws_iam_policy_document" "queue" {
  statement {
    sid       = "OnlySpotguardRules"
    actions   = ["sqs:SendMessage"]
    resources = [aws_sqs_queue.events.arn]

    principals {
      type        = "Service"
      identifiers = ["events.amazonaws.com"]
    }

    condition {
      test     = "ArnEquals"
      variable = "aws:SourceArn"
      values   = local.event_rule_arns
    }
  }
}

resource "aws_sqs_queue_policy" "events" {
  queue_url = aws_sqs_queue.events.id
  policy    = data.aws_iam_policy_document.queue.json
}

resource "aws_cloudwatch_event_rule" "interruptions" {
  for_each = local.event_patterns

  name          = "${var.name}-${each.key}"
  description   = "${var.name}: forward ${join(", ", each.value["detail-type"])} events to the fleet queue"
  event_pattern = jsonencode(each.value)
  tags          = local.tags
}

resource "aws_cloudwatch_event_target" "interruptions" {
  for_each = local.event_patterns

  rule      = aws_cloudwatch_event_rule.interruptions[each.key].name
  target_id = "fleet-queue"
  arn       = aws_sqs_queue.events.arn
}
